"""Activation recompute (spec §1.6), applied to a model from outside.

Granularities map onto modules of the model: `full` → `blocks[i]`, `full_attn` →
`blocks[i].attn`, `core_attn` → `blocks[i].attn.core`. The chosen module's *instance* forward
is replaced by one that runs the original under `torch.utils.checkpoint` (non-reentrant, RNG
state preserved so dropout masks replay exactly). No wrapper module is inserted, so
state_dict keys, module paths and later module swaps (fake-quant, pruning) are unaffected.
Recompute is active only when the module is training, autograd is on and no KV cache is
passed, so generation never pays for it.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gptforge.errors import ConfigError

GRANULARITIES = ("full", "full_attn", "core_attn")
_ATTR = "_gptforge_recompute"


def recompute_unit(block: nn.Module, granularity: str) -> nn.Module:
    """The module of `block` that `granularity` checkpoints."""
    if granularity == "full":
        return block
    if granularity == "full_attn":
        return block.attn
    if granularity == "core_attn":
        return block.attn.core
    raise ConfigError(f"Model.recompute_granularity: {granularity!r} is not one of {', '.join(GRANULARITIES)}")


def _has_cache(args, kwargs) -> bool:
    from gptforge.model.gpt import KVCache

    return any(isinstance(a, KVCache) for a in (*args, *kwargs.values()))


def _recompute_forward(self: nn.Module, *args, **kwargs):
    """Instance forward installed by `apply_recompute` (a bound method, so deepcopy rebinds it)."""
    inner = functools.partial(type(self).forward, self)
    if self.training and torch.is_grad_enabled() and not _has_cache(args, kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    return inner(*args, **kwargs)


def apply_recompute(model: nn.Module, granularity: str | None,
                    no_recompute_layers: list[int] | tuple[int, ...] = ()) -> list[str]:
    """Checkpoint the `granularity` unit of every block not in `no_recompute_layers`.

    Returns the module paths that were wrapped. Calling it again first removes any earlier
    recompute, so the last call wins; `granularity=None` only removes.
    """
    remove_recompute(model)
    if granularity is None:
        return []
    skip = set(no_recompute_layers or ())
    wrapped = []
    for i, block in enumerate(model.blocks):
        if i in skip:
            continue
        unit = recompute_unit(block, granularity)
        unit.forward = types.MethodType(_recompute_forward, unit)
        setattr(unit, _ATTR, granularity)
        wrapped.append(f"blocks.{i}" + {"full": "", "full_attn": ".attn", "core_attn": ".attn.core"}[granularity])
    return wrapped


def remove_recompute(model: nn.Module) -> None:
    """Undo `apply_recompute`."""
    for m in model.modules():
        if hasattr(m, _ATTR):
            delattr(m, _ATTR)
            # The instance attribute shadows the class forward; deleting it restores the original.
            m.__dict__.pop("forward", None)
