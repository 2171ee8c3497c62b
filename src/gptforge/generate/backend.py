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
import weakref
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from gptforge.adapters.layers import LoraPair
from gptforge.adapters.multi import router_of
from gptforge.config.sampling import kv_cache_dtype_name
from gptforge.device import tune_cpu_allocator
from gptforge.errors import ConfigError
from gptforge.generate import fused_step
from gptforge.model.kv_cache import KV_DTYPES
from gptforge.transforms import fp32_gemv, head_screen, huge_pages, native_kernels
from gptforge.transforms.weight_only import WeightOnlyLinear


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


# Prompts are prefilled in chunks of this many tokens at fixed offsets (0, 32, 64, ...), by
# `generate` as by `serve`'s scheduler: SDPA's per-row results depend on how queries are
# blocked, so both must cut a prompt the same way for bit-identical results. Small chunks also
# bound how long a prefill stalls the running decodes in `serve`.
PREFILL_CHUNK = 32


def prefill_chunks(length: int, start: int = 0) -> list[tuple[int, int]]:
    """[(start, end)] chunks covering positions start..length-1, cut at multiples of PREFILL_CHUNK."""
    out = []
    while start < length:
        end = min(length, (start // PREFILL_CHUNK + 1) * PREFILL_CHUNK)
        out.append((start, end))
        start = end
    return out


# The row count the packed weights are laid out for. oneDNN's small-batch blocking (any value > 1)
# computes every output row with the same kernel and the same reduction order whatever the number
# of rows (measured bit-identical for 1..300 rows, 1 and 2 threads), so a sequence's logits do not
# depend on what else shares its batch: `gptforge serve` (continuous batching) and `generate` at
# any batch size produce bit-identical results for a prompt. The GEMV layout made for one row
# is not batch-invariant and is not used.
PACKED_LAYOUT_ROWS = 8


def packed_rows_invariant(n: int, k: int, rows=(1, 2, 5), seed: int = 0) -> dict[int, float]:
    """{row count: max |difference|} where oneDNN's packed fp32 Linear ([n, k] weight, this module's
    layout) gives the first rows of a batch of that many rows other bits than computed in pairs: what
    batch invariance (served = generate bit for bit) rests on. Empty on the AVX2 machines measured; not
    on a Xeon with AMX under torch 2.11 (benchmarks/results/2026-11-26-avx512-check.md)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=g) * 0.05, PACKED_LAYOUT_ROWS)
    xs = torch.randn(max(rows) + 8, k, generator=g)

    def run(x):
        return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    ref = torch.stack([run(xs[i:i + 1].repeat(2, 1))[0] for i in range(8)])
    bad = {}
    for m in rows:
        ys = run(xs[:m])[:8] if m >= 8 else torch.cat([run(xs[i:i + m])[:1] for i in range(8)])
        if not torch.equal(ys, ref):
            bad[m] = float((ys - ref).abs().max())
    return bad


def _packed_linear_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and ops is not None
                    and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):  # pragma: no cover - builds without oneDNN
        return False


@dataclass
class _Packed:
    weight: weakref.ref  # the exact Parameter the copy was made from
    stamp: tuple  # (data_ptr, version counter, fingerprint, rows layout)
    tensor: torch.Tensor | None  # None: a GEMV copy whose exactness check failed


# Packed copies outlive one call: repacking the 124M model costs ~0.19 s (~3 ms per token of
# a 64-token generation). A copy is reused only if it comes from the same Parameter object with
# the same storage, version counter (bumped by every in-place update: optimizer steps,
# load_state_dict, copy_) and content fingerprint (catches writes through `.data`); otherwise it
# is rebuilt. The entries die with their module; `release_packed(model)` frees them earlier. A
# module may have several packed weights (a LoRA pair's A and B), by name.
_PACKED: weakref.WeakKeyDictionary[nn.Module, dict[str, _Packed]] = weakref.WeakKeyDictionary()


def _stamp(weight: torch.Tensor, rows: int) -> tuple:
    try:
        version = weight._version
    except RuntimeError:  # an inference-mode tensor has no version counter
        version = -1
    with torch.no_grad():
        fingerprint = float(weight.sum())  # one read of the weight: ~16 ms for GPT-2 124M
    return weight.data_ptr(), version, fingerprint, rows


def packed_weight(module: nn.Module, weight: torch.Tensor, rows: int, name: str = "weight") -> torch.Tensor:
    """`weight` (the module's `name`) reordered by oneDNN for GEMMs of about `rows` rows, cached
    per module and name."""
    layout = 1 if rows == 1 else 8  # one-row GEMV vs small-batch blocking (the backend uses the latter)
    stamp = _stamp(weight, layout)
    entries = _PACKED.setdefault(module, {})
    entry = entries.get(name)
    if entry is not None and entry.weight() is weight and entry.stamp == stamp:
        return entry.tensor
    entries.pop(name, None)  # free the stale copy before making the new one
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), layout)
    entries[name] = _Packed(weakref.ref(weight), stamp, packed)
    return packed


def gemv_weight(module: nn.Module, weight: torch.Tensor, path: str) -> torch.Tensor:
    """`weight` in the native kernels' 64-output blocks (`transforms/fp32_gemv.py`), made once and
    cached per module like the packed copies (a changed weight gets new blocks)."""
    stamp = _stamp(weight, ("gemv", path))
    entries = _PACKED.setdefault(module, {})
    entry = entries.get("gemv")
    if entry is not None and entry.weight() is weight and entry.stamp == stamp:
        return entry.tensor
    entries.pop("gemv", None)  # free the stale copy before making the new one
    wb = fp32_gemv.block_weight(weight)
    entries["gemv"] = _Packed(weakref.ref(weight), stamp, wb)
    return wb


def release_packed(model: nn.Module) -> None:
    """Free the packed weight copies `fast_cpu_decode` keeps for `model`."""
    for mod in model.modules():
        _PACKED.pop(mod, None)


def _packed_forward(module: nn.Linear, packed: torch.Tensor | None, x: torch.Tensor, gemv=None) -> torch.Tensor:
    """`gemv`: (64-output blocks, ISA path) where gptforge's native kernels run (`gemv_weight`; then
    no oneDNN copy is made), else None and `packed`, oneDNN's packed copy. Under autograd and for
    other dtypes, the module's own product."""
    if x.dtype == torch.float32 and not x.requires_grad and not torch.is_grad_enabled():
        if gemv is not None:
            return _native_product(x, gemv, module.bias, module.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")
    return F.linear(x, module.weight, module.bias)


def _native_product(x: torch.Tensor, gemv: tuple, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x · Wᵀ (+ bias), every output summed in the native kernels' one order (`fp32_gemv.py`): the
    GEMV for one row, else the same chains for every row with the rows sharing each weight load, so
    a row's bits never depend on the other rows (0.96-1.9x oneDNN's packed kernel on the blocks'
    shapes at 1-128 rows on the AVX2 EPYC, results/2026-11-26-fp32-rows.md; 0.89-1.69x on AVX-512
    Zen 5, results/2026-11-27-zen5-avx512.md)."""
    if x.numel() == x.shape[-1]:
        return native_kernels.fp32_gemv(x, gemv[0], bias, n, gemv[1])
    y = native_kernels.fp32_rows(x.reshape(-1, x.shape[-1]), gemv[0], bias, n, gemv[1])
    return y.view(*x.shape[:-1], n)


def _packed_low_rank(pair: LoraPair, a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A LoRA pair's B·A·x through packed A and B: the same per-row results whatever rows share
    the GEMM, so an adapter's tokens decode alike alone (`generate --adapter`) and served in a
    batch mixed with other adapters' rows (adapters.multi)."""
    if x.dtype == torch.float32 and not (torch.is_grad_enabled() and (x.requires_grad or pair.lora_A.requires_grad)):
        mid = torch.ops.mkldnn._linear_pointwise(x, a, None, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise(mid, b, None, "none", [], "")
    return F.linear(F.linear(x, pair.lora_A), pair.lora_B)


def _gemv(module: nn.Module, weight: torch.Tensor, path: str | None) -> tuple | None:
    """(blocks, path) of the GEMV / fp32_rows for a layer, or None where no native path runs."""
    return None if path is None else (gemv_weight(module, weight, path), path)


class TorchBackend:
    """`StepBackend` over our `GPT` (or any module with the same `hidden_states` / `logits` /
    `new_cache` API) and its preallocated `KVCache`.

    Only the last position is projected onto the vocabulary. On CPU in fp32 with `prepack`
    (`Generation.fast_cpu_decode`), every plain `nn.Linear` and the tied head get a
    oneDNN-packed copy of their weight at the first step, used while the backend is open
    (`with TorchBackend(m) as b:`): a decode step is a handful of skinny matrix products bound
    by reading the weights, which the packed layout does faster than MKL's GEMM on row-major
    weights (see docs/generate.md for figures), and its per-row results do not depend on the
    number of rows (`PACKED_LAYOUT_ROWS`), which makes decoding batch-invariant (LoRA pairs'
    A and B are packed too, so adapters stay batch-invariant, also served several at once). The
    copies cost one extra set of Linear + embedding weights; they are kept for the next call
    while the weights are unchanged (`release_packed(model)` frees them). Where gptforge's native
    kernels run, the fp32 products of those Linears and the head take them instead at any row
    count (`_native_product`; their 64-output blocks replace the oneDNN copy): their one summation order
    makes decoding batch-invariant on every such CPU, also where oneDNN's own kernel is not
    (AVX-512 Zen 5: its 3072-input products differ between one row and several). Modules that
    quantization or other wrappers replaced are not `nn.Linear` and keep their own forward.
    `use_cache=False` recomputes the whole sequence every step (a reference path).
    `kv_cache_dtype` (`Generation.kv_cache_dtype`: auto | float32 | bfloat16 | int8) is the dtype
    its caches and slots store keys/values in (`model/kv_cache.py`); auto: the model's own.
    """

    def __init__(self, model: nn.Module, prepack: bool = True, use_cache: bool = True,
                 kv_cache_dtype: str = "auto"):
        self.model = model
        self.kv_dtype = kv_storage_dtype(kv_cache_dtype)  # None: the model's own
        w = model.wte.weight
        self.device = w.device
        self.vocab_size = int(w.shape[0])
        self.max_positions = int(model.config.max_position_embeddings)
        self.use_cache = use_cache
        self.prepack = (prepack and w.device.type == "cpu" and w.dtype == torch.float32
                        and _packed_linear_available())
        self._patched: list[nn.Linear] = []
        self._gelus: list[nn.GELU] = []  # routed through native_kernels.gelu_forward while open
        self._head: torch.Tensor | None = None
        self._head_gemv: tuple | None = None  # (64-output blocks, ISA path): one-row logits
        self._was_training = False
        self._open = False
        self._packed_rows = 0  # 0: not packed (yet)
        self._slot_layout: tuple | None = None
        self._router = None  # the served adapters' router (adapters.multi), found at the first routed step
        self._linear_ops: dict[nn.Module, tuple] = {}  # patched Linear -> (packed copy, one-row GEMV or None)
        self._fused: fused_step.FusedDecode | None = None  # batch-1 decode in one call (`fused_step`)
        self._fused_key: tuple | None = None  # the forcing variables `_fused` was built under
        self.fused_steps = 0  # steps that took the fused path (tests, benchmarks)
        self._screener = head_screen.HeadScreener()  # greedy rows' argmax without the whole head

    # -- lifetime ----------------------------------------------------------------------------

    def __enter__(self) -> TorchBackend:
        self._was_training = self.model.training
        self.model.eval()
        self._open = True
        if self.device.type == "cpu":
            tune_cpu_allocator()  # else a many-row step page-faults its fresh buffers in every step
            native = native_kernels.unavailable() is None
            for mod in self.model.modules():
                if isinstance(mod, WeightOnlyLinear):  # its kernels stream the weight itself (the head too)
                    huge_pages.rehome_(mod, "weight")
                # The tanh GELU on csrc/gelu.cpp (ATen's: ~4 ns an element, 2-4% of a step), in every
                # step, so that the fused batch-1 step (which runs it too) and ragged steps agree.
                elif (native and type(mod) is nn.GELU and mod.approximate == "tanh" and not mod._forward_hooks
                      and "forward" not in mod.__dict__):
                    mod.forward = native_kernels.gelu_forward
                    self._gelus.append(mod)
        return self

    def __exit__(self, *exc) -> None:
        self._open = False
        for mod in self._gelus:
            mod.__dict__.pop("forward", None)
        self._gelus.clear()
        self._slot_layout = None
        self._screener.reset()
        self._unpack()
        self._packed_rows = 0
        self.model.train(self._was_training)

    @property
    def packed_rows(self) -> int:
        """The row count the packed weights were laid out for; 0 when not packed."""
        return self._packed_rows if self._head is not None or self._head_gemv is not None or self._patched else 0

    def _pack(self, rows: int) -> None:
        """Route Linears, LoRA pairs and the head through weights packed for GEMMs of `rows` rows."""
        self._packed_rows = rows
        path = native_kernels.isa() if fp32_gemv.available() else None  # the native GEMV / fp32_rows (issue #32)
        try:
            for mod in self.model.modules():
                # Exact type: quantized or otherwise wrapped Linears keep their own forward.
                if type(mod) is nn.Linear and "forward" not in mod.__dict__ and mod.weight.dtype == torch.float32:
                    g = _gemv(mod, mod.weight, path)
                    packed = None if g is not None else packed_weight(mod, mod.weight, rows)
                    mod.forward = lambda x, _m=mod, _p=packed, _g=g: _packed_forward(_m, _p, x, _g)
                    self._linear_ops[mod] = (packed, g)
                    self._patched.append(mod)
                elif isinstance(mod, LoraPair) and "low_rank" not in mod.__dict__ and mod.lora_A.dtype == torch.float32:
                    a = packed_weight(mod, mod.lora_A, rows, "lora_A")
                    b = packed_weight(mod, mod.lora_B, rows, "lora_B")
                    mod.low_rank = lambda x, _m=mod, _a=a, _b=b: _packed_low_rank(_m, _a, _b, x)
                    self._patched.append(mod)
            if type(self.model.wte) is nn.Embedding:
                self._head_gemv = _gemv(self.model.wte, self.model.wte.weight, path)
                if self._head_gemv is None:
                    self._head = packed_weight(self.model.wte, self.model.wte.weight, rows)
        except RuntimeError:  # an unusual build or layout: the plain path is always correct
            self._unpack()

    def _unpack(self) -> None:
        for mod in self._patched:
            mod.__dict__.pop("forward", None)
            mod.__dict__.pop("low_rank", None)
        self._patched.clear()
        self._linear_ops.clear()
        self._fused, self._fused_key = None, None
        self._head = None
        self._head_gemv = None

    # -- the step interface -------------------------------------------------------------------

    def new_cache(self, batch_size: int, max_len: int) -> Any:
        if not self.use_cache:
            return _Recompute()
        return self.model.new_cache(batch_size, max_len, dtype=self.kv_dtype)

    @torch.inference_mode()
    def step(self, input_ids, position_ids, attention_mask, cache) -> torch.Tensor:
        self._ensure_packed()
        if isinstance(cache, _Recompute):
            input_ids, position_ids, attention_mask = cache.extend(input_ids, position_ids, attention_mask)
            cache = None
        T = input_ids.shape[1]
        if cache is None or T <= PREFILL_CHUNK:
            h = self.model.hidden_states(input_ids, position_ids, attention_mask, cache)[:, -1]
            return self.project(h)
        # A long prompt is prefilled in the chunks continuous batching uses (`prefill_chunks`),
        # so a prompt's keys/values are bit-identical whether it is generated here or served.
        past = cache.length
        for s, e in prefill_chunks(T):
            mask = attention_mask[:, : past + e] if attention_mask is not None else None
            h = self.model.hidden_states(input_ids[:, s:e], position_ids[:, s:e], mask, cache)
        return self.project(h[:, -1])

    def _ensure_packed(self) -> None:
        if self.prepack and self._open and not self._packed_rows:
            self._pack(PACKED_LAYOUT_ROWS)

    def project(self, h: torch.Tensor, argmax_masks=None) -> torch.Tensor:
        """Vocabulary logits (float32) of final hidden states [R, hidden]. `argmax_masks` (one
        `head_screen.Mask` per row): only each row's greedy choice is read, so the head may be
        screened (`transforms/head_screen.py`): -inf except where the choice can be."""
        out = self._screener.logits(self.model, self._head_gemv, h, argmax_masks) if self._open else None
        if out is not None:
            return out
        # Several rows take fp32_rows too since it prefetches the weights that stream from memory:
        # 1.12-1.23x oneDNN's packed kernel on the 124M head at 4-64 rows, the same bits
        # (results/2026-11-27-rows-prefetch.md; before, 0.89-1.11x kept the head on oneDNN).
        if self._head_gemv is not None:
            g, path = self._head_gemv
            logits = (native_kernels.fp32_gemv(h, g, None, self.vocab_size, path) if h.shape[0] == 1
                      else native_kernels.fp32_rows(h, g, None, self.vocab_size, path))
        elif self._head is not None:
            logits = torch.ops.mkldnn._linear_pointwise(h, self._head, None, "none", [], "")
        else:
            logits = self.model.logits(h)
        return logits.float()

    # -- per-sequence slots (continuous batching, `gptforge.generate.slots`) -------------------

    def new_slot(self, capacity: int):
        """KV buffers for one sequence of up to `capacity` positions."""
        from gptforge.generate.slots import SeqSlot, slot_layout

        if self._slot_layout is None:  # probed once per open backend (the model may change between uses)
            self._slot_layout = slot_layout(self.model, self.kv_dtype)
        return SeqSlot.for_model(self.model, capacity, self._slot_layout)

    @torch.inference_mode()
    def step_ragged(self, batch) -> torch.Tensor:
        """One forward over a `RaggedBatch` (each sequence's new tokens, packed into one row);
        returns the logits [R, V] of the rows `batch` asks for, in its order."""
        self._ensure_packed()
        fused = self._fused_decode(batch)
        if fused is not None:
            h = fused(batch)[0]
            self.fused_steps += 1
        else:
            with self._routed(getattr(batch, "adapter_rows", None)):
                h = self.model.hidden_states(batch.input_ids, batch.position_ids, None, batch)[0]
        batch.commit()
        return self.project(h.index_select(0, batch.logits_index), batch.argmax_masks)

    def _fused_decode(self, batch) -> fused_step.FusedDecode | None:
        """The fused one-sequence step where it applies to `batch` and the model (built at the first
        such step of an open backend, and again when a forcing variable changes), else None."""
        if not self._open or not fused_step.applies(batch, self.model):
            return None
        key = fused_step.env_key()
        if key != self._fused_key:
            self._fused = fused_step.build(self.model, self._linear_ops) if fused_step.enabled() else None
            self._fused_key = key
        return self._fused

    def _routed(self, rows):
        """Route the rows of served adapters (`rows`: name -> rows of the packed row) for one pass."""
        if not rows:
            return contextlib.nullcontext()
        if self._router is None:
            self._router = router_of(self.model) or False
        if not self._router:
            raise ValueError(f"the model serves no LoRA adapters (asked for {sorted(rows)})")
        return self._router.route(rows, self.device)

    @torch.inference_mode()
    def step_all(self, input_ids, position_ids, attention_mask, cache) -> torch.Tensor:
        """Like `step`, but the logits of every new position, [B, T, V] float32 (speculative
        decoding verifies T draft tokens in one pass)."""
        self._ensure_packed()  # the one batch-invariant layout, whatever the row count
        h = self.model.hidden_states(input_ids, position_ids, attention_mask, cache)
        B, T = h.shape[:2]
        return self.project(h.reshape(B * T, -1)).view(B, T, -1)

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


def kv_storage_dtype(kv_cache_dtype: str | None) -> torch.dtype | None:
    """The torch dtype a `Generation.kv_cache_dtype` stores keys/values in; None for auto."""
    name = kv_cache_dtype_name("auto" if kv_cache_dtype is None else kv_cache_dtype)
    return None if name == "auto" else KV_DTYPES[name]


def check_kv_cache_dtype(backend, kv_cache_dtype: str) -> None:
    """`ConfigError` when `backend` (not our model) cannot store its cache in `kv_cache_dtype`:
    a StepBackend without `kv_dtype` keeps whatever it keeps (onnxruntime: float32 arrays)."""
    if kv_storage_dtype(kv_cache_dtype) in (None, torch.float32) or hasattr(backend, "kv_dtype"):
        return
    raise ConfigError(f"Generation.kv_cache_dtype={kv_cache_dtype}: the {type(backend).__name__} backend keeps "
                      "its past keys/values in float32; use float32 (or auto), or run the PyTorch model "
                      "(gptforge generate --ckpt DIR)")


def as_backend(model_or_backend, prepack: bool = True, use_cache: bool = True, kv_cache_dtype: str = "auto"):
    """A context manager yielding a `StepBackend`: our models are wrapped in `TorchBackend`;
    anything else must already implement the interface (its lifetime is the caller's) and
    store its cache in float32 unless it says otherwise (`check_kv_cache_dtype`)."""
    if isinstance(model_or_backend, nn.Module):
        return TorchBackend(model_or_backend, prepack=prepack, use_cache=use_cache, kv_cache_dtype=kv_cache_dtype)
    if not isinstance(model_or_backend, StepBackend):
        raise TypeError(f"expected a GPT model or a StepBackend, got {type(model_or_backend).__name__}")
    check_kv_cache_dtype(model_or_backend, kv_cache_dtype)
    return contextlib.nullcontext(model_or_backend)
