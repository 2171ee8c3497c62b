"""Training checkpoints: atomic step directories, exact resume, keep-last, latest-complete.

A step checkpoint `output_dir/step_{N}` (N = optimizer steps done) is a model directory
(`model.safetensors`, `config.yaml`, tokenizer files: `gptforge eval --ckpt` loads it) plus
the training state:

- `training_state.pt`: optimizer, LR-scheduler and loss-scaler state and the torch / CUDA /
  numpy / python RNG states. Plain tensors and containers only, so it loads with
  `torch.load(weights_only=True)`.
- `trainer_state.json`: step, consumed train/eval samples, epoch, last loss and lr; written
  last, human-readable.

The directory is assembled under a hidden temporary name and renamed into place
(`model_io.atomic_dir`), so a crash or SIGKILL mid-write leaves at most a stale temp dir that
the next run removes, and every `step_N` directory is complete.

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
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gptforge.errors import CheckpointError
from gptforge.model_io import WEIGHTS_FILE, atomic_dir, write_model_files

STATE_FILE = "training_state.pt"
META_FILE = "trainer_state.json"
STEP_RE = re.compile(r"^step_(\d+)$")
TMP_RE = re.compile(r"^\.step_\d+\.tmp-")


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


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete step checkpoints under `output_dir`, oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for c in out.iterdir():
        m = STEP_RE.match(c.name)
        if m and c.is_dir() and is_complete(c):
            found.append((int(m.group(1)), c))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete step checkpoint under `output_dir`, or None."""
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1][1] if ckpts else None


def resolve_resume_dir(path: str | Path) -> Path:
    """A step checkpoint, or a run directory (→ its newest complete step)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: resume checkpoint not found")
    if is_complete(p):
        return p
    latest = latest_checkpoint(p) if p.is_dir() else None
    if latest is not None:
        return latest
    if (p / WEIGHTS_FILE).is_file():
        raise CheckpointError(
            f"{p}: a model directory without training state ({STATE_FILE}, {META_FILE}); to start a new "
            f"run from its weights use -o Compress.pretrained={p}"
        )
    raise CheckpointError(f"{p}: not a training checkpoint (expected step_N directories or {STATE_FILE})")


def clean_stale_tmp(output_dir: str | Path) -> list[Path]:
    """Remove temp dirs left by a save that was killed mid-write."""
    out = Path(output_dir)
    removed = []
    if out.is_dir():
        for c in out.iterdir():
            if c.is_dir() and (TMP_RE.match(c.name) or c.name.startswith(".step_") and ".old-" in c.name):
                shutil.rmtree(c, ignore_errors=True)
                removed.append(c)
    return removed


def prune_checkpoints(output_dir: str | Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest `keep_last` step checkpoints."""
    if not keep_last or keep_last <= 0:
        return []
    ckpts = list_checkpoints(output_dir)
    doomed = [p for _, p in ckpts[:-keep_last]]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# ------------------------------------------------------------------------- save / load


def save_checkpoint(output_dir: str | Path, step: int, model: nn.Module, cfg, tokenizer,
                    optimizer: torch.optim.Optimizer, scheduler, precision, meta: dict,
                    keep_last: int | None = None) -> Path:
    """Write `output_dir/step_{step}` atomically; returns its path."""
    dest = Path(output_dir) / step_dir_name(step)
    state = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "precision": precision.state_dict(),
        "rng": rng_state(),
    }
    meta = {"step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **meta}
    with atomic_dir(dest, overwrite=True) as tmp:
        write_model_files(model, cfg, tmp, tokenizer)
        torch.save(state, tmp / STATE_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    prune_checkpoints(output_dir, keep_last)
    return dest


def read_meta(path: str | Path) -> dict:
    f = Path(path) / META_FILE
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
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
