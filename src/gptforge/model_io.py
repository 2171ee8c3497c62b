"""Model directories in any supported format, read and written in one place.

Formats:
- ours: `config.yaml` (the resolved config) + `model.safetensors` + tokenizer files;
  training checkpoints add optimizer/scheduler/RNG state files next to them. Distributed
  step checkpoints hold torch.distributed.checkpoint shards (`.metadata`) instead of
  `model.safetensors`; they read as full weights in one process.
- hf: an HF `transformers` GPT-2 directory (`config.json` + safetensors or .bin weights).
- paddle: a PaddleFleetX `model.pdparams` (a file, or a directory holding one).
A directory of step checkpoints (`.../step_N`) resolves to its newest complete one.

Structure a checkpoint records about itself (fake-quant modules of a QAT run, narrowed
layers of an edited model) is rebuilt from the checkpoint's own config before its weights
load, so a model always loads exactly as it was saved.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gptforge.config.presets import PRESETS
from gptforge.device import recorded_device_here
from gptforge.durable import publish_dir, recover_aside
from gptforge.errors import CheckpointError, GPTForgeError
from gptforge.fsguard import disk_full_errno, disk_full_error

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"
DCP_METADATA = ".metadata"
OURS, HF, PADDLE = "gptforge", "hf", "paddle"


def _notice(msg: str) -> None:
    print(f"gptforge: {msg}", file=sys.stderr)


def _is_ours(p: Path) -> bool:
    # A distributed (DCP) step checkpoint of ours has `.metadata` + shards instead of one weights file.
    return (p / CONFIG_FILE).is_file() and ((p / WEIGHTS_FILE).is_file() or (p / DCP_METADATA).is_file())


def _step_of(p: Path) -> int:
    m = re.search(r"step_(\d+)$", p.name)
    return int(m.group(1)) if m else -1


def resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    """The model directory (or .pdparams file) that `path` names; step-checkpoint parents
    resolve to their newest complete step."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: checkpoint not found")
    if p.is_file():
        if p.suffix == ".pdparams":
            return p
        if p.name in (CONFIG_FILE, WEIGHTS_FILE, "config.json"):
            return resolve_checkpoint_path(p.parent)
        raise CheckpointError(f"{p}: is a file, expected a directory (a model directory) or a .pdparams file")
    if _is_ours(p) or (p / "config.json").is_file() or (p / "model.pdparams").is_file():
        return p
    steps = sorted((c for c in p.iterdir() if c.is_dir() and _is_ours(c) and _step_of(c) >= 0), key=_step_of)
    if steps:
        return steps[-1]
    if (p / DCP_METADATA).is_file():
        raise CheckpointError(
            f"{p}: a torch.distributed.checkpoint directory without the {CONFIG_FILE} that gptforge writes next "
            "to it; only gptforge's distributed step checkpoints (step_N) can be read"
        )
    raise CheckpointError(
        f"{p}: not a model directory (expected config.yaml + model.safetensors, an HF GPT-2 directory "
        "with config.json, or model.pdparams)"
    )


def has_tokenizer_files(d: str | os.PathLike) -> bool:
    """Whether directory `d` carries a tokenizer of its own (`tokenizer.json`, or
    `vocab.json` + `merges.txt`): a model directory's own files win over a recorded path."""
    p = Path(d)
    return (p / "tokenizer.json").is_file() or ((p / "vocab.json").is_file() and (p / "merges.txt").is_file())


def detect_format(path: str | os.PathLike) -> str:
    p = resolve_checkpoint_path(path)
    if _is_ours(p):
        return OURS
    if p.is_file() or (p / "model.pdparams").is_file():
        return PADDLE
    return HF


# ------------------------------------------------------------------------------- configs


def _hf_weight_shapes(p: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    files = sorted(p.glob("*.safetensors"))
    if files:
        shapes = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for k in sf.keys():  # noqa: SIM118 - safe_open is not iterable
                        shapes[k] = tuple(sf.get_slice(k).get_shape())
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
                raise CheckpointError(f"{f}: unreadable ({e}); the file is truncated or corrupted") from None
        return shapes
    return {k: tuple(v.shape) for k, v in _hf_tensors(p).items()}


def _hf_tensors(p: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(p.glob("*.safetensors"))
    if files:
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                sd.update(load_file(str(f)))
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{f}: unreadable ({e}); the file is truncated or corrupted") from None
        return sd
    bins = sorted(p.glob("pytorch_model*.bin"))
    if not bins:
        raise CheckpointError(f"{p}: no model.safetensors or pytorch_model.bin weights")
    sd = {}
    for f in bins:
        try:
            sd.update(torch.load(str(f), map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:  # noqa: BLE001 - pickles with code are refused here
            raise CheckpointError(f"{f}: cannot load safely as plain tensors ({type(e).__name__})") from None
    return sd


def _preset_heads(hidden: int, layers: int) -> int | None:
    for shape in PRESETS.values():
        if shape["hidden_size"] == hidden and shape["num_layers"] == layers:
            return shape["num_attention_heads"]
    return None


def read_checkpoint_config(path: str | os.PathLike) -> dict[str, Any]:
    """The raw (canonical-layout) config dict a checkpoint carries."""
    from gptforge.config.aliases import normalize_raw
    from gptforge.config.loader import read_yaml
    from gptforge.model import convert

    p = resolve_checkpoint_path(path)
    fmt = detect_format(p)
    if fmt == OURS:
        return _our_config(p / CONFIG_FILE, normalize_raw(read_yaml(p / CONFIG_FILE)))
    if fmt == HF:
        model = convert.hf_config_to_model(convert.read_json(p / "config.json"), str(p / "config.json"))
        head_dim = model["hidden_size"] // model["num_attention_heads"]
        heads, ffns = convert.hf_layer_shapes(_hf_weight_shapes(p), head_dim)
        if heads and any(h != model["num_attention_heads"] for h in heads):
            model["head_dim"] = head_dim
            model["layer_num_heads"] = heads
        if ffns and any(f != model["ffn_hidden_size"] for f in ffns):
            model["layer_ffn_sizes"] = ffns
        return {"Model": model}
    arrays = _pdparams(p)
    model = convert.paddle_shapes(arrays)
    heads = _preset_heads(model["hidden_size"], model["num_layers"])
    raw: dict[str, Any] = {"Model": model}
    if heads is not None:
        model["num_attention_heads"] = heads
    else:
        raw["__requires__"] = ["Model.num_attention_heads"]
    return raw


# Shape keys every config.yaml we write records; without them the file is not whole.
_SHAPE_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "max_position_embeddings")


def _our_config(f: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (a checkpoint's config.yaml) if it is a whole config; a truncated or damaged one
    is a CheckpointError naming the file rather than a model silently built from defaults."""
    from gptforge.config.resolve import apply_preset
    from gptforge.config.typed import build_config
    from gptforge.errors import ConfigError

    model = raw.get("Model")
    missing = [k for k in _SHAPE_KEYS if not isinstance(model, dict) or k not in model]
    if missing and not (isinstance(model, dict) and model.get("preset")):
        raise CheckpointError(f"{f}: {'empty' if not raw else 'no Model.' + missing[0]}; the file is truncated "
                              "or was not written by gptforge (copy it again from the original checkpoint)")
    try:
        build_config(apply_preset(dict(raw)))
    except ConfigError as e:
        raise CheckpointError(f"{f}: {e}; the file is truncated or corrupted") from None
    return raw


def checkpoint_config(path: str | os.PathLike):
    """What a model directory records about its run, for `config.load_config(ckpt=...)`."""
    from gptforge.config.loader import CheckpointConfig

    p = resolve_checkpoint_path(path)
    raw, foreign = recorded_device_here(read_checkpoint_config(p))
    return CheckpointConfig(source=str(path), raw=raw, path=p, is_dir=p.is_dir(),
                            has_tokenizer=p.is_dir() and has_tokenizer_files(p), foreign_device=foreign)


def load_run_config(path: str | os.PathLike | None = None, overrides=(), ckpt_dir: str | os.PathLike | None = None,
                    world_size: int | None = None):
    """`config.load_config` with a model directory's config as the layer under the file:
    defaults ← checkpoint ← file (`path`) ← overrides."""
    from gptforge.config import load_config

    ckpt = checkpoint_config(ckpt_dir) if ckpt_dir is not None else None
    return load_config(path, overrides, ckpt=ckpt, world_size=world_size)


_PD_CACHE: dict[tuple[str, float], Any] = {}


def _pdparams(p: Path):
    """Arrays of a .pdparams checkpoint, parsed once per file version (they are read for the
    config and again for the weights)."""
    from gptforge.model import convert

    f = p if p.is_file() else p / "model.pdparams"
    key = (str(f.resolve()), f.stat().st_mtime)
    if key not in _PD_CACHE:
        _PD_CACHE.clear()
        _PD_CACHE[key] = convert.read_pdparams(f)
    return _PD_CACHE[key]


def checkpoint_model_config(path: str | os.PathLike, fallback=None):
    """The resolved model shape a checkpoint holds. `fallback` (a ModelConfig) supplies what the
    file does not record (a .pdparams has no head count)."""
    from gptforge.config import ARCH_KEYS, resolve_model
    from gptforge.config.schema import ModelConfig
    from gptforge.config.typed import build_section
    from gptforge.errors import ConfigError
    from gptforge.model import convert

    p = resolve_checkpoint_path(path)
    raw = read_checkpoint_config(p)
    model_raw = dict(raw.get("Model") or {})
    if "Model.num_attention_heads" in raw.get("__requires__", []):
        if fallback is None:
            raise ConfigError(f"Model.num_attention_heads: the checkpoint {p} does not record it; "
                              "pass -o Model.num_attention_heads=N")
        model_raw["num_attention_heads"] = fallback.num_attention_heads
    m = build_section(ModelConfig, {k: v for k, v in model_raw.items() if k in ARCH_KEYS}, "Model")
    resolve_model(m, 1)
    if detect_format(p) == PADDLE:
        heads = convert.paddle_layer_heads(_pdparams(p), m.num_layers, m.head_dim)
        if any(h != m.num_attention_heads for h in heads):
            m.layer_num_heads = heads
    return m


# ------------------------------------------------------------------------------ weights


def _checkpoint_state_dict(p: Path, fmt: str, model_cfg) -> dict[str, torch.Tensor]:
    from gptforge.model import convert

    if fmt == OURS:
        from safetensors.torch import load_file

        if not (p / WEIGHTS_FILE).is_file():
            from gptforge.dcp_read import read_model_tensors

            return read_model_tensors(p)
        try:
            return load_file(str(p / WEIGHTS_FILE))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{p / WEIGHTS_FILE}: unreadable ({e})") from None
    if fmt == HF:
        sd = convert.hf_to_ours(_hf_tensors(p), model_cfg.num_layers)
        return convert.regroup_qkv(sd, model_cfg.head_dim, to_grouped=False)
    sd, ignored = convert.paddle_to_ours(_pdparams(p), model_cfg.num_layers, model_cfg.head_dim)
    if ignored:
        shown = ", ".join(ignored[:4]) + (" ..." if len(ignored) > 4 else "")
        _notice(f"{p}: ignored {len(ignored)} non-model tensors ({shown})")
    return sd


def _weights_source(p: Path, fmt: str) -> str:
    """The file (or directory, for sharded weights) that errors about the weights should name."""
    if fmt == PADDLE:
        return str(p if p.is_file() else p / "model.pdparams")
    files = sorted(p.glob("*.safetensors")) or sorted(p.glob("pytorch_model*.bin"))
    return str(files[0]) if len(files) == 1 else str(p)


def _apply_recorded_structure(model, ckpt_raw: dict[str, Any], weight_only=None) -> None:
    """Rebuild structure the checkpoint was saved with (fake-quant modules; INT8 modules of a
    converted model; weight-only low-bit modules)."""
    if weight_only is not None:  # a WeightOnlySpec (`gptforge quantize --weights`)
        return weight_only.apply(model)
    quant = ((ckpt_raw.get("Compress") or {}).get("Quantization") or {})
    if quant.get("enable"):
        from gptforge.config.schema import QuantizationConfig
        from gptforge.config.typed import build_section

        try:
            from gptforge.transforms.int8 import int8_structure
            from gptforge.transforms.quant import quantize_model
        except ImportError as e:  # pragma: no cover - part of the package
            raise CheckpointError(f"checkpoint was saved with quantization but it is unavailable ({e})") from None
        qcfg = build_section(QuantizationConfig, quant, "Compress.Quantization")
        (int8_structure if qcfg.converted else quantize_model)(model, qcfg)


def load_model(path: str | os.PathLike, cfg=None, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, with_structure: bool = True):
    """(model in eval mode, config) from a checkpoint of any supported format.

    `cfg` (optional) supplies run settings such as dropout; the shape always comes from the
    checkpoint. `with_structure=False` loads only the float weights into a plain model.
    """
    from gptforge.config import ARCH_KEYS, load_config
    from gptforge.model import build_model
    from gptforge.transforms.weight_only import read_spec

    p = resolve_checkpoint_path(path)
    fmt = detect_format(p)
    if cfg is None:
        cfg = load_config(ckpt=checkpoint_config(p))
    shape = checkpoint_model_config(p, fallback=cfg.Model)
    model_cfg = dataclasses.replace(cfg.Model, **{k: getattr(shape, k) for k in ARCH_KEYS})
    model = build_model(model_cfg, device="meta")
    ck_raw = read_checkpoint_config(p) if with_structure or fmt == OURS else {}
    wo = read_spec(p) if fmt == OURS and p.is_dir() else None  # weight_only.json
    if with_structure:
        _apply_recorded_structure(model, ck_raw, wo)
    sd = _checkpoint_state_dict(p, fmt, model_cfg)
    if not with_structure:
        if ((ck_raw.get("Compress") or {}).get("Quantization") or {}).get("converted"):
            from gptforge.transforms.int8 import dequantize_state_dict

            sd = dequantize_state_dict(sd)  # int8 weights x steps -> float weights
        elif wo is not None:
            sd = wo.dequantize(sd)  # int8 / int4 / bf16 weights -> float weights
        names = set(model.state_dict())
        sd = {k: v for k, v in sd.items() if k in names}
    load_state_dict_checked(model, sd, _weights_source(p, fmt))
    model = model.to(device=device or "cpu", dtype=dtype)
    model.eval()
    return model, dataclasses.replace(cfg, Model=model_cfg)


def load_state_dict_checked(model: torch.nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    """`load_state_dict(assign=True)` with errors that name the tensors and the likely cause."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        parts = [f"{what} {len(ks)} tensors (e.g. {', '.join(ks[:3])})"
                 for what, ks in (("missing", missing), ("unexpected", unexpected)) if ks]
        raise CheckpointError(f"{source}: weights do not match the model: " + "; ".join(parts))
    for k, t in expected.items():
        if tuple(t.shape) != tuple(sd[k].shape):
            raise CheckpointError(
                f"{source}: tensor {k} has shape {tuple(sd[k].shape)} but the model expects {tuple(t.shape)}; "
                "the Model section does not describe this checkpoint"
            )
    check_dtypes(expected, sd, source)
    sd = {k: v.to(expected[k].dtype) if v.is_floating_point() else v for k, v in sd.items()}
    model.load_state_dict(sd, strict=True, assign=True)


def check_dtypes(expected: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], source: str) -> None:
    """CheckpointError naming the tensor when a checkpoint holds integers (or bools) where the
    model has floats, or a different integer type where it has integers (INT8 weights): a copy
    would cast them silently into nonsense weights."""
    for k, t in expected.items():
        if k not in sd:
            continue
        v = sd[k]
        ok = v.is_floating_point() if t.is_floating_point() else v.dtype == t.dtype
        if not ok:
            want = "a floating-point tensor" if t.is_floating_point() else str(t.dtype).replace("torch.", "")
            raise CheckpointError(
                f"{source}: tensor {k} is {str(v.dtype).replace('torch.', '')} but the model expects {want}; "
                "the file is corrupted or was not written as model weights"
            )


# ------------------------------------------------------------------------------- saving


def atomic_dir(out_dir: str | os.PathLike, overwrite: bool = False):
    """Context manager yielding a temp dir that replaces `out_dir` only when the block succeeds."""
    return _AtomicDir(Path(out_dir), overwrite)


class _AtomicDir:
    def __init__(self, out: Path, overwrite: bool):
        self.out, self.overwrite = out, overwrite

    def __enter__(self) -> Path:
        if self.out.exists() and not self.out.is_dir():
            raise CheckpointError(f"{self.out}: is a file, expected a directory; choose another output path")
        if self.out.exists() and not self.overwrite:
            raise CheckpointError(f"{self.out}: already exists (pass --force to overwrite)")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        recover_aside(self.out.parent, self.out.name)  # a replacement a killed writer left half done
        # The writer's pid in the name: a later run removes the temp only once this process is gone.
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-{os.getpid()}-", dir=self.out.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            # Every writer (safetensors, torch.save, tokenizers, onnx) words a full disk its own
            # way; say it once, naming the directory that was not published.
            if isinstance(exc, Exception) and not isinstance(exc, GPTForgeError):
                code = disk_full_errno(exc)
                if code is not None:
                    raise disk_full_error(self.out, code) from None
            return
        _umask_modes(self.tmp)
        publish_dir(self.tmp, self.out)  # fsync, then rename; `out` always names one complete copy


def _umask_modes(d: Path) -> None:
    """mkdtemp makes 0700 dirs (and safetensors 0600 files); give outputs the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(d, 0o777 & ~umask)
    for f in d.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)


def state_dict_for_save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU, contiguous, de-duplicated tensors ready for safetensors."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}


def write_model_files(model: torch.nn.Module, cfg, dest: Path, tokenizer=None) -> None:
    """Write model.safetensors + config.yaml (+ tokenizer) into an existing directory."""
    from safetensors.torch import save_file

    import gptforge
    from gptforge.config import config_to_yaml

    save_file(state_dict_for_save(model), str(dest / WEIGHTS_FILE), metadata={"format": "pt", "gptforge": gptforge.__version__})
    (dest / CONFIG_FILE).write_text(config_to_yaml(cfg), encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save(dest)


def save_model_dir(model: torch.nn.Module, cfg, out_dir: str | os.PathLike, tokenizer=None,
                   overwrite: bool = False) -> Path:
    """Save a model directory atomically (a crash never leaves a half-written directory)."""
    with atomic_dir(out_dir, overwrite) as tmp:
        write_model_files(model, cfg, tmp, tokenizer)
    return Path(out_dir)


def hf_state_dict(model: torch.nn.Module, model_cfg) -> dict[str, torch.Tensor]:
    """HF GPT2LMHeadModel tensors for a model of uniform shape (float weights only)."""
    from gptforge.model import convert

    sd = convert.regroup_qkv(dict(state_dict_for_save(model)), model_cfg.head_dim, to_grouped=True)
    return convert.ours_to_hf(sd, model_cfg.num_layers)


def save_hf_dir(model: torch.nn.Module, cfg, out_dir: str | os.PathLike, tokenizer=None,
                overwrite: bool = False) -> Path:
    """Write a directory `transformers` loads offline: config.json, model.safetensors,
    generation_config.json and tokenizer files. Uniform shapes only; `gptforge export
    --format hf` also handles models with fewer heads, QAT models and sharding."""
    import json

    from safetensors.torch import save_file

    from gptforge.model import convert

    m = cfg.Model
    if m.layer_num_heads or m.layer_ffn_sizes or m.head_dim * m.num_attention_heads != m.hidden_size:
        raise CheckpointError("this model's shape is not a stock GPT-2 shape; use `gptforge export --format hf`")
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    with atomic_dir(out_dir, overwrite) as tmp:
        save_file(hf_state_dict(model, m), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(convert.model_to_hf_config(m, eos), indent=2))
        gen = {"_from_model_config": True}
        if eos is not None:
            gen.update(bos_token_id=eos, eos_token_id=eos)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if tokenizer is not None:
            tokenizer.save(tmp)
    return Path(out_dir)
