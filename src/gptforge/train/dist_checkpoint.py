"""Distributed step checkpoints with torch.distributed.checkpoint (DCP), and resume across formats.

A run with more than one process writes `output_dir/step_N` as:

- `.metadata` + `__<rank>_0.distcp`: model weights and AdamW state, keyed by parameter name
  (`model.<name>`, `optim.state.<name>.exp_avg`, ...), each rank writing its own shards;
  DCP reshards on load, so a checkpoint saved at one world size / layout loads at another;
- `config.yaml` + tokenizer files (rank 0), as in every model directory;
- `training_state.pt` (rank 0): scheduler and loss-scaler state and every rank's RNG state;
- `trainer_state.json` (rank 0, written last): step, consumed samples and the layout
  (`distributed`: world size and degrees).

All ranks write into one temporary directory `.step_N.tmp-dist` (the output directory must be
on a filesystem every node sees), then rank 0 renames it into place after a barrier and
applies `keep_last`: a crash leaves at most the temp dir, which the next run removes.

Resume works in every direction: a DCP checkpoint into any world size (world 1 included, no
process group needed), and a single-process checkpoint (`model.safetensors` +
`training_state.pt`) into a distributed run. RNG streams continue exactly only when the layout
is unchanged; otherwise each rank is reseeded from its dropout seed and the step.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from gptforge.dcp_read import METADATA_FILE, dcp_load, is_distributed_checkpoint, read_model_tensors  # noqa: F401
from gptforge.errors import CheckpointError
from gptforge.train import checkpoint as ckpt

_OPTIONS = None


def _options():
    # Parameter-name keys make optimizer state independent of how parameters are grouped
    # (distributed runs split groups per tensor kind).
    global _OPTIONS
    if _OPTIONS is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
    return _OPTIONS


def _notice(msg: str) -> None:
    print(f"gptforge: {msg}", file=sys.stderr)


# Group options that describe this run's kernels and bookkeeping, not the training state: they
# stay as this run built them (a fused single-process AdamW resumes as foreach over DTensors).
_OWN_OPTIONS = ("names", "foreach", "fused", "capturable", "differentiable")
_OWN_SUFFIXES = tuple(f".{k}" for k in _OWN_OPTIONS)


def _optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Flattened, name-keyed optimizer state (a template on load: state is created if empty).
    Group options that belong to the run rather than to the state (`_OWN_OPTIONS`, e.g. the
    informational `names`, which would list a whole group per parameter) are left out."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, optimizer, options=_options())
    return {k: v for k, v in sd.items() if not (k.startswith("param_groups.") and k.endswith(_OWN_SUFFIXES))}


def _set_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer, flat: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    own = {}
    for g in optimizer.param_groups:
        for n in g.get("names", ()):
            own.update({f"param_groups.{n}.{k}": g[k] for k in _OWN_OPTIONS if k in g})
    set_optimizer_state_dict(model, optimizer, {**flat, **own}, options=_options())


# --------------------------------------------------------------------------------- save


def save_distributed(output_dir: str | os.PathLike, step: int, model: nn.Module, cfg, tokenizer,
                     optimizer: torch.optim.Optimizer, scheduler, precision, meta: dict, par,
                     keep_last: int | None = None) -> Path:
    """Write `output_dir/step_{step}` from every rank (collective); returns its path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from gptforge.config import config_to_yaml
    from gptforge.model_io import CONFIG_FILE

    out = Path(output_dir)
    dest = out / ckpt.step_dir_name(step)
    tmp = out / f".{dest.name}.tmp-dist"
    if par.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    par.barrier()
    state = {"model": get_model_state_dict(model), "optim": _optim_state(model, optimizer)}
    dcp.save(state, checkpoint_id=tmp)
    rngs = par.gather_object(ckpt.rng_state())
    if par.is_main:
        (tmp / CONFIG_FILE).write_text(config_to_yaml(cfg), encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save(tmp)
        torch.save({"scheduler": scheduler.state_dict(), "precision": precision.state_dict(), "rng_per_rank": rngs},
                   tmp / ckpt.STATE_FILE)
        meta = {"step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **meta, "format": "dcp",
                "distributed": par.record()}
        (tmp / ckpt.META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        ckpt.prune_checkpoints(out, keep_last)
    par.barrier()
    return dest


# --------------------------------------------------------------------------------- load


def _load_dcp_optimizer(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, par) -> None:
    template = _optim_state(model, optimizer)
    try:
        dcp_load({"optim": template}, path, no_dist=not par.distributed)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: optimizer state does not fit this model's parameters "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    _set_optim_state(model, optimizer, template)


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `like` (a plain copy, or this rank's shard of a DTensor)."""
    from torch.distributed.tensor import DTensor, Replicate

    full = full.to(device=like.device, dtype=like.dtype)
    if not isinstance(like, DTensor):
        return full
    mesh = like.device_mesh
    rep = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return rep.redistribute(mesh, like.placements)  # Replicate → Shard is a local slice


def _load_full_optimizer(saved: dict, source: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A single-process optimizer state_dict (index-keyed, groups with `names`) into a sharded run."""
    by_name: dict[str, tuple[dict, dict]] = {}
    for g in saved["param_groups"]:
        names = g.get("names")
        if names is None:
            raise CheckpointError(f"{source / ckpt.STATE_FILE}: optimizer groups carry no parameter names; "
                                  "resume it in one process")
        for idx, name in zip(g["params"], names, strict=True):
            by_name[name] = (saved["state"].get(idx, {}), g)
    template = _optim_state(model, optimizer)
    for key, like in template.items():
        kind, rest = key.split(".", 1)
        name, field = rest.rsplit(".", 1)
        if name not in by_name:
            raise CheckpointError(f"{source / ckpt.STATE_FILE}: no optimizer state for parameter {name}")
        state, group = by_name[name]
        src = state if kind == "state" else group
        if field not in src:
            raise CheckpointError(f"{source / ckpt.STATE_FILE}: optimizer state {name}.{field} missing")
        template[key] = _shard_like(src[field], like) if isinstance(like, torch.Tensor) else src[field]
    _set_optim_state(model, optimizer, template)


def load_training_state(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler, precision, par) -> dict:
    """Restore optimizer/scheduler/scaler/RNG state from a step checkpoint of either format
    into this run's layout; returns the checkpoint's meta."""
    p = Path(path)
    dcp_format = is_distributed_checkpoint(p)
    if not dcp_format and not par.distributed:
        return ckpt.load_training_state(p, optimizer, scheduler, precision)
    f = p / ckpt.STATE_FILE
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from None
    if dcp_format:
        _load_dcp_optimizer(p, model, optimizer, par)
    else:
        _load_full_optimizer(state["optimizer"], p, model, optimizer)
    scheduler.load_state_dict(state["scheduler"])
    precision.load_state_dict(state["precision"])
    meta = ckpt.read_meta(p)
    saved_layout = meta.get("distributed") or {"world_size": 1}
    rngs = state.get("rng_per_rank") or [state.get("rng")]
    if saved_layout == par.record() and len(rngs) == par.world_size:
        ckpt.set_rng_state(rngs[par.rank])
    else:
        par.seed_rngs(int(meta["step"]))
        if par.is_main:
            _notice(f"resuming {p} (world {saved_layout.get('world_size')}) with world {par.world_size}: weights, "
                    "optimizer, schedule and data position continue exactly; dropout RNG streams restart")
    return meta


__all__ = ["is_distributed_checkpoint", "load_training_state", "read_model_tensors", "save_distributed"]
