"""The seam between the decode loops and a model: a small "step" interface.

The loops in `search.py` / `beam.py` only ever call a `StepBackend`:

    cache  = backend.new_cache(batch_size, max_len)
    logits = backend.step(input_ids, position_ids, attention_mask, cache)   # [B, V] float32
    cache  = backend.reorder(cache, index)                                  # beam search

`step` consumes `input_ids` [B, T] (the whole left-padded prompt on the first call, one token
per row afterwards) at `position_ids` [B, T], with `attention_mask` [B, past+T] (1 = real token)
or None when no row is padded, appends their keys/values to `cache`, and returns the logits of
the last position only. `TorchBackend` implements it for our `GPT` + `KVCache`; an ONNX Runtime
model with past-key-value inputs/outputs implements the same four members and reuses the loops.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn


@runtime_checkable
class StepBackend(Protocol):
    """What the decode loops need from a model (see the module docstring)."""

    device: torch.device
    vocab_size: int  # width of the logits `step` returns
    max_positions: int  # longest sequence (prompt + generated) the model can attend over

    def new_cache(self, batch_size: int, max_len: int) -> Any: ...

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None, cache: Any) -> torch.Tensor: ...

    def reorder(self, cache: Any, index: torch.Tensor) -> Any: ...


# Rows (batch x new tokens) up to which a Linear runs through its packed copy: decode steps
# and beam batches; longer prefill matmuls are compute-bound and MKL's own GEMM is as good.
PACKED_MAX_ROWS = 64


def _packed_linear_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and ops is not None
                    and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):  # pragma: no cover - builds without oneDNN
        return False


def _packed_forward(module: nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.numel() <= PACKED_MAX_ROWS * x.shape[-1] and x.dtype == torch.float32 and not x.requires_grad:
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")
    return F.linear(x, module.weight, module.bias)


class TorchBackend:
    """`StepBackend` over our `GPT` (or any module with the same `hidden_states` / `logits` /
    `new_cache` API) and its preallocated `KVCache`.

    Only the last position is projected onto the vocabulary. On CPU in fp32 with `prepack`
    (`Generation.fast_cpu_decode`), every plain `nn.Linear` and the tied head get a
    oneDNN-packed copy of their weight at the first decode step, used while the backend is open
    (`with TorchBackend(m) as b:`) for inputs of at most `PACKED_MAX_ROWS` rows: a decode step
    is a handful of skinny matrix products bound by reading the weights, which the packed layout
    does faster than MKL's GEMM on row-major weights (see docs/generate.md for figures). The
    copies cost one extra set of Linear + embedding weights and are dropped when the backend
    closes. Modules that quantization or other wrappers replaced are not `nn.Linear` and keep
    their own forward.
    `use_cache=False` recomputes the whole sequence every step (a reference path).
    """

    def __init__(self, model: nn.Module, prepack: bool = True, use_cache: bool = True):
        self.model = model
        w = model.wte.weight
        self.device = w.device
        self.vocab_size = int(w.shape[0])
        self.max_positions = int(model.config.max_position_embeddings)
        self.use_cache = use_cache
        self.prepack = (prepack and w.device.type == "cpu" and w.dtype == torch.float32
                        and _packed_linear_available())
        self._patched: list[nn.Linear] = []
        self._head: torch.Tensor | None = None
        self._was_training = False
        self._open = False
        self._packed_rows = 0  # 0: not packed (yet)

    # -- lifetime ----------------------------------------------------------------------------

    def __enter__(self) -> TorchBackend:
        self._was_training = self.model.training
        self.model.eval()
        self._open = True
        return self

    def __exit__(self, *exc) -> None:
        self._open = False
        self._unpack()
        self._packed_rows = 0
        self.model.train(self._was_training)

    @property
    def packed_rows(self) -> int:
        """The row count the packed weights were laid out for; 0 when not packed."""
        return self._packed_rows if self._head is not None or self._patched else 0

    def _pack(self, rows: int) -> None:
        """Pack the weights for GEMMs of `rows` rows (the decode batch: oneDNN picks its blocking
        from it; at batch 8 this is ~20% faster than a layout chosen for one row)."""
        self._packed_rows = rows
        try:
            for mod in self.model.modules():
                # Exact type: quantized or otherwise wrapped Linears keep their own forward.
                if type(mod) is nn.Linear and "forward" not in mod.__dict__ and mod.weight.dtype == torch.float32:
                    packed = torch.ops.mkldnn._reorder_linear_weight(mod.weight.detach(), rows)
                    mod.forward = lambda x, _m=mod, _p=packed: _packed_forward(_m, _p, x)
                    self._patched.append(mod)
            if type(self.model.wte) is nn.Embedding:
                self._head = torch.ops.mkldnn._reorder_linear_weight(self.model.wte.weight.detach(), rows)
        except RuntimeError:  # an unusual build or layout: the plain path is always correct
            self._unpack()

    def _unpack(self) -> None:
        for mod in self._patched:
            mod.__dict__.pop("forward", None)
        self._patched.clear()
        self._head = None

    # -- the step interface -------------------------------------------------------------------

    def new_cache(self, batch_size: int, max_len: int) -> Any:
        if not self.use_cache:
            return _Recompute()
        return self.model.new_cache(batch_size, max_len)

    @torch.inference_mode()
    def step(self, input_ids, position_ids, attention_mask, cache) -> torch.Tensor:
        if self.prepack and self._open and not self._packed_rows and input_ids.shape[1] == 1:
            self._pack(input_ids.shape[0])  # at the first decode step, when the batch is known
        if isinstance(cache, _Recompute):
            input_ids, position_ids, attention_mask = cache.extend(input_ids, position_ids, attention_mask)
            cache = None
        h = self.model.hidden_states(input_ids, position_ids, attention_mask, cache)[:, -1]
        if self._head is not None and h.shape[0] <= PACKED_MAX_ROWS:
            logits = torch.ops.mkldnn._linear_pointwise(h, self._head, None, "none", [], "")
        else:
            logits = self.model.logits(h)
        return logits.float()

    @torch.inference_mode()
    def reorder(self, cache, index: torch.Tensor):
        cache.reorder(index)
        return cache


class _Recompute:
    """Stand-in cache for `use_cache=False`: remembers the inputs and replays them in full."""

    def __init__(self):
        self.ids = self.pos = self.mask = None

    def extend(self, ids, pos, mask):
        if self.ids is None:
            self.ids, self.pos, self.mask = ids, pos, mask
        else:
            self.ids = torch.cat([self.ids, ids], 1)
            self.pos = torch.cat([self.pos, pos], 1)
            self.mask = mask
        return self.ids, self.pos, self.mask

    def reorder(self, index: torch.Tensor) -> None:
        self.ids = self.ids.index_select(0, index)
        self.pos = self.pos.index_select(0, index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)


def as_backend(model_or_backend, prepack: bool = True, use_cache: bool = True):
    """A context manager yielding a `StepBackend`: our models are wrapped in `TorchBackend`;
    anything else must already implement the interface (its lifetime is the caller's)."""
    if isinstance(model_or_backend, nn.Module):
        return TorchBackend(model_or_backend, prepack=prepack, use_cache=use_cache)
    if not isinstance(model_or_backend, StepBackend):
        raise TypeError(f"expected a GPT model or a StepBackend, got {type(model_or_backend).__name__}")
    return contextlib.nullcontext(model_or_backend)
