"""Training checkpoints: atomic step directories, exact resume, keep-last, latest-complete.

A step checkpoint `output_dir/step_{N}` (N = optimizer steps done) is a model directory
(`model.safetensors`, `config.yaml`, tokenizer files: `gptforge eval --ckpt` loads it) plus
the training state:

- `training_state.pt`: optimizer, LR-scheduler and loss-scaler state and the torch / CUDA /
  numpy / python RNG states. Plain tensors and containers only, so it loads with
  `torch.load(weights_only=True)`.
- `trainer_state.json`: step, consumed train/eval samples, epoch, last loss and lr; written
  last, human-readable.

The directory is assembled under a hidden temporary name carrying the writer's pid, fsynced
and renamed into place (`model_io.atomic_dir`), so a crash or SIGKILL mid-write leaves at most a
temp dir that the next run removes once its writer is dead, and every `step_N` directory is
complete. Replacing an existing `step_N` swaps the two directories atomically (or renames the old
one aside and `clean_stale_tmp` puts it back if the writer died in between).

Lineage: `trainer_state.json` records the `run_id` of the run that wrote it (kept across
resumes), and `keep_last` deletes only checkpoints of the same run.

This is the format of a single-process run. A run over several processes writes
torch.distributed.checkpoint shards instead of `model.safetensors` (and no optimizer in
`training_state.pt`): see `dist_checkpoint.py`; the helpers here find and prune both.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gptforge.durable import recover_aside
from gptforge.errors import CheckpointError, ConfigError
from gptforge.model_io import WEIGHTS_FILE, atomic_dir, check_dtypes, write_model_files
from gptforge.run_lock import path_writer_alive

STATE_FILE = "training_state.pt"
META_FILE = "trainer_state.json"
STEP_RE = re.compile(r"^step_(\d+)$")
CKPT_RE = re.compile(r"^(step|epoch)_(\d+)$")  # finetune also saves epoch_N
TMP_RE = re.compile(r"^\.(step|epoch)_\d+\.tmp-")
TMP_PID_RE = re.compile(r"^\.(?:step|epoch)_\d+\.tmp-(\d+)-")  # .step_N.tmp-<pid>-<random>
ANY_RUN = object()  # prune_checkpoints: every lineage


def step_dir_name(step: int) -> str:
    return f"step_{step}"


# --------------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """Every RNG a training step draws from, as tensors and plain Python values."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "python": {"version": py_state[0], "state": list(py_state[1]), "gauss": py_state[2]},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


# ---------------------------------------------------------------------------- finding


def is_complete(path: Path) -> bool:
    """A step directory with every file a resume needs (single-process weights, or the
    `.metadata` of a distributed checkpoint: see dist_checkpoint.py)."""
    weights = (path / WEIGHTS_FILE).is_file() or (path / ".metadata").is_file()
    return weights and all((path / f).is_file() for f in ("config.yaml", STATE_FILE, META_FILE))


def _step_of(path: Path, kinds: tuple[str, ...]) -> int | None:
    """The step a checkpoint directory named `<kind>_N` holds (epoch_N: from its meta), else None."""
    m = CKPT_RE.match(path.name)
    if m is None or m.group(1) not in kinds or not path.is_dir():
        return None
    if m.group(1) == "step":
        return int(m.group(2))
    try:
        return int(json.loads((path / META_FILE).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def list_checkpoints(output_dir: str | Path, kinds: tuple[str, ...] = ("step",)) -> list[tuple[int, Path]]:
    """Complete checkpoints (`step_N`; `kinds` adds finetune's `epoch_N`) under `output_dir`, as
    (step, path), oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for c in out.iterdir():
        n = _step_of(c, kinds)
        if n is not None and is_complete(c):
            found.append((n, c))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path, kinds: tuple[str, ...] = ("step",)) -> Path | None:
    """The newest complete checkpoint under `output_dir`, or None."""
    ckpts = list_checkpoints(output_dir, kinds)
    return ckpts[-1][1] if ckpts else None


def resolve_resume_dir(path: str | Path, kinds: tuple[str, ...] = ("step",)) -> Path:
    """A checkpoint, or a run directory (→ its newest complete checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: resume checkpoint not found")
    if not p.is_dir():
        raise CheckpointError(f"{p}: is a file, expected a directory (a step_N checkpoint or its run directory)")
    if is_complete(p):
        return p
    latest = latest_checkpoint(p, kinds)
    if latest is not None:
        return latest
    if (p / WEIGHTS_FILE).is_file():
        raise CheckpointError(
            f"{p}: a model directory without training state ({STATE_FILE}, {META_FILE}); to start a new "
            f"run from its weights use -o Compress.pretrained={p}"
        )
    raise CheckpointError(f"{p}: not a training checkpoint (expected step_N directories or {STATE_FILE})")


def clean_stale_tmp(output_dir: str | Path) -> list[Path]:
    """Remove temp dirs of saves whose writer is dead (killed mid-write), and put back a
    `step_N` that a killed writer had renamed aside but not yet replaced. A temp dir without a
    pid in its name (older versions, the distributed `.tmp-dist`) counts as dead: the caller
    holds the directory's lock, so no other writer of this version is at work here."""
    out = Path(output_dir)
    removed = []
    if not out.is_dir():
        return removed
    recover_aside(out)
    for c in out.iterdir():
        if c.is_dir() and TMP_RE.match(c.name):
            m = TMP_PID_RE.match(c.name)
            if m is not None and path_writer_alive(int(m.group(1)), c):
                continue
            shutil.rmtree(c, ignore_errors=True)
            removed.append(c)
    return removed


def new_run_id() -> str:
    """A fresh lineage id for a run started from step 0."""
    return uuid.uuid4().hex[:12]


def run_id_of(path: str | Path) -> str | None:
    """The lineage id a step checkpoint records (None: written before run ids existed)."""
    try:
        return json.loads((Path(path) / META_FILE).read_text(encoding="utf-8")).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def foreign_checkpoints(output_dir: str | Path, run_id: str | None,
                        kinds: tuple[str, ...] = ("step",)) -> list[Path]:
    """Checkpoints in `output_dir` written by another run than `run_id`, oldest first: complete
    ones of another lineage, and model directories of that name without training state (an
    older version's finetune saved those)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for c in out.iterdir():
        m = CKPT_RE.match(c.name)
        if m is None or m.group(1) not in kinds or not c.is_dir():
            continue
        complete = is_complete(c)
        if (complete and run_id_of(c) != run_id) or (not complete and (c / WEIGHTS_FILE).is_file()):
            found.append((_step_of(c, kinds) or int(m.group(2)), c.name, c))
    return [p for *_, p in sorted(found)]


def prune_checkpoints(output_dir: str | Path, keep_last: int | None, run_id=ANY_RUN) -> list[Path]:
    """Delete all but the newest `keep_last` step checkpoints of lineage `run_id` (default: all)."""
    if not keep_last or keep_last <= 0:
        return []
    ckpts = [(n, p) for n, p in list_checkpoints(output_dir) if run_id is ANY_RUN or run_id_of(p) == run_id]
    doomed = [p for _, p in ckpts[:-keep_last]]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def check_shape_overrides(overrides, model_cfg, ckpt_dir: str | Path) -> None:
    """Refuse `-o Model.<shape key>=...` (or `Model.preset`) that differs from the shape of the
    checkpoint being resumed: a resumed run keeps its shape, so the override would be ignored."""
    from gptforge.config import ARCH_KEYS
    from gptforge.config.aliases import normalize_path
    from gptforge.model_io import checkpoint_model_config

    keys = []
    for o in overrides or ():
        key = ".".join(normalize_path(str(o).split("=", 1)[0].strip()))
        if key.startswith("Model.") and (key[6:] in ARCH_KEYS or key[6:] == "preset"):
            keys.append(key[6:])
    if not keys:
        return
    shape = checkpoint_model_config(ckpt_dir, fallback=model_cfg)
    for k in keys:
        names = ARCH_KEYS if k == "preset" else (k,)
        for name in names:
            if _shape_value(getattr(model_cfg, name)) != _shape_value(getattr(shape, name)):
                raise ConfigError(
                    f"Model.{k}: {getattr(model_cfg, k)} differs from the resumed checkpoint {ckpt_dir} "
                    f"(Model.{name}: {getattr(shape, name)}); a resumed run keeps its shape: drop -o Model.{k} "
                    "or start a new run in another output directory")


def _shape_value(v):
    return None if v in ([], (), None) else (list(v) if isinstance(v, (list, tuple)) else v)


# ------------------------------------------------------------------------- save / load


def save_checkpoint(output_dir: str | Path, step: int, model: nn.Module, cfg, tokenizer,
                    optimizer: torch.optim.Optimizer, scheduler, precision, meta: dict,
                    keep_last: int | None = None) -> Path:
    """Write `output_dir/step_{step}` atomically; returns its path."""
    dest = Path(output_dir) / step_dir_name(step)
    with atomic_dir(dest, overwrite=True) as tmp:
        write_model_files(model, cfg, tmp, tokenizer)
        write_training_state(tmp, step, optimizer, scheduler, precision, meta)
    prune_checkpoints(output_dir, keep_last, meta.get("run_id"))
    return dest


def write_training_state(directory: Path, step: int, optimizer: torch.optim.Optimizer, scheduler, precision,
                         meta: dict) -> None:
    """`training_state.pt` (optimizer, scheduler, scaler, RNG) and `trainer_state.json` (`step` + `meta`)
    into a checkpoint directory being assembled (finetune's classifier directories use it too)."""
    state = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "precision": precision.state_dict(),
        "rng": rng_state(),
    }
    torch.save(state, directory / STATE_FILE)
    meta = {"step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **meta}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def read_meta(path: str | Path) -> dict:
    f = Path(path) / META_FILE
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON or not UTF-8
        raise CheckpointError(f"{f}: unreadable ({e})") from None


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Copy a checkpoint's weights into `model` in place (parameters keep their identity)."""
    from safetensors.torch import load_file

    f = Path(path) / WEIGHTS_FILE
    if not f.is_file() and (Path(path) / ".metadata").is_file():
        from gptforge.dcp_read import read_model_tensors

        sd = read_model_tensors(path)
    else:
        try:
            sd = load_file(str(f))
        except Exception as e:  # noqa: BLE001 - safetensors raises several types
            raise CheckpointError(f"{f}: unreadable ({e})") from None
    expected = model.state_dict()
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{f}: weights do not match the model being trained (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); resume with the same model structure (e.g. the same Compress settings)"
        )
    for k, t in expected.items():
        if tuple(t.shape) != tuple(sd[k].shape):
            raise CheckpointError(f"{f}: tensor {k} has shape {tuple(sd[k].shape)} but the model expects "
                                  f"{tuple(t.shape)}")
    check_dtypes(expected, sd, str(f))
    model.load_state_dict(sd, strict=True)


def load_training_state(path: str | Path, optimizer: torch.optim.Optimizer, scheduler, precision,
                        restore_rng: bool = True) -> dict:
    """Restore optimizer/scheduler/scaler (and RNG) state from a step checkpoint; returns its meta."""
    f = Path(path) / STATE_FILE
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from None
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{f}: optimizer state does not fit this model's parameters ({e})") from None
    scheduler.load_state_dict(state["scheduler"])
    precision.load_state_dict(state["precision"])
    if restore_rng:
        set_rng_state(state["rng"])
    return read_meta(path)
