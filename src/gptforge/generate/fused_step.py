"""The fused one-sequence decode step (issue #32): the whole block stack of a batch-1 decode
token in one call into C++ (`transforms/csrc/fused_decode.cpp`).

At batch 1 the decode step of a small GPT spends as long in the interpreter (module calls,
~500 ATen op dispatches) as in its weight-only matrix products. When a ragged step is exactly
one sequence adding one token through the native decode attention (the batch-1 `generate` case,
and `serve` with one request), `TorchBackend.step_ragged` hands it to `FusedDecode`: the
embedding runs in Python (`GPT.embed`), then one op runs every block and the final layer norm,
calling the same ATen ops and gptforge kernels on tensors of the same shapes in the same order
as the Python forward, so the hidden state, and the logits the backend's head makes of it, are
bit for bit the Python step's (tests/test_fused_decode.py). Served output stays generate's
whatever shares the batch.

It applies to plain GPT blocks (no MoE, no hooks, no wrapped or adapted Linears) whose Linears
run as the backend runs them for one fp32 row: its packed copies (`_linear_ops`: the one-row
GEMV or oneDNN's packed kernel), plain `nn.Linear`, weight-only int8 / int4 / bf16 layers on
the `native` / `native-q8a` kernels (their own `kernel_for` choice), or real INT8 layers with
static activation steps on gptforge's `native` int8 kernel (`transforms/int8.kernel_path`), also
where that path is fbgemm's one-call `plain` (VNNI's `auto`) once a check per layer finds the
int8 kernel giving plain's bits (`_native_gives_plains_bits`). Anything else (LoRA, MoE, INT8
layers on fbgemm's other paths or with per-call steps, bf16 KV slots, prefill,
several sequences, tensor parallel) keeps the Python path, as does `GPTFORGE_FUSED_DECODE=off`
and any machine without the native kernels.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import nn

from gptforge.model.gpt import BLOCK_LINEARS, GPT, Block, SelfAttention
from gptforge.transforms import native_kernels
from gptforge.transforms.cpu_kernels import KERNEL_ENV as INT8_KERNEL_ENV
from gptforge.transforms.cpu_kernels import requested_choice
from gptforge.transforms.int8 import Int8Linear, fast_kernel_available, kernel_path, native_ready
from gptforge.transforms.weight_only import KERNEL_ENV, WeightOnlyLinear

FUSED_ENV = "GPTFORGE_FUSED_DECODE"
CHOICES = ("auto", "off")
# How a Linear runs (csrc/fused_decode.cpp's `Kind`).
GEMV, PACKED, PLAIN, WEIGHT_ONLY, WEIGHT_ONLY_Q8A, INT8 = range(6)


def env_key() -> tuple:
    """What decides whether and how the fused step runs: the forcing variables (re-read every step)."""
    env = os.environ
    return env.get(FUSED_ENV), env.get(KERNEL_ENV), env.get(native_kernels.ISA_ENV), env.get(INT8_KERNEL_ENV)


def enabled() -> bool:
    """`GPTFORGE_FUSED_DECODE`: auto (default: fused where it applies) or off (the Python step)."""
    return requested_choice(None, FUSED_ENV, CHOICES, FUSED_ENV) == "auto"


def applies(batch, model: nn.Module) -> bool:
    """Whether a `RaggedBatch` is one sequence adding one token through the native decode
    attention, with its logits wanted, no adapter, and nothing hooked into the model's modules."""
    return (len(batch.segments) == 1 and len(batch.native) == 1 and not batch.adapter_rows
            and batch.logits_index.numel() == 1 and not model.training and not _global_hooks())


def _global_hooks() -> bool:
    m = nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks)


@dataclass
class FusedDecode:
    """A built plan over `model` (its weights are referenced, never copied)."""

    plan: object  # torch.classes.gptforge_wo.DecodePlan
    model: GPT

    def __call__(self, batch) -> torch.Tensor:
        """The final-LayerNorm hidden state [1, 1, hidden] of the batch's one token; its key and
        value are written into the slot (the caller commits the batch)."""
        seg = batch.segments[0]
        slot = seg.slot
        x = self.model.embed(batch.input_ids, batch.position_ids)
        isa = native_kernels.ISA_CODES[native_kernels.isa()]
        return _op()(self.plan, x, slot.k, slot.v, slot.k_scale or [], slot.v_scale or [], seg.start, isa)


@functools.lru_cache(maxsize=1)
def _op():
    # The C++ function under the op: torch's Python wrappers of an op that takes a script object (the
    # plan) search every argument (lists of KV tensors) for fake script objects on each call, ~0.1 ms
    # a step; only tracing passes fake ones, and nothing traces this step.
    overload = torch.ops.gptforge_wo.fused_decode.default
    return getattr(overload, "_op", overload)


def build(model: nn.Module, linear_ops: dict) -> FusedDecode | None:
    """The fused step for `model`, or None where any part of its block stack would not run as the
    Python forward runs it. `linear_ops`: {nn.Linear: (oneDNN packed copy, (GEMV blocks, ISA path)
    or None)}, the backend's routing of its patched Linears."""
    if type(model) is not GPT or "hidden_states" in model.__dict__ or "embed" in model.__dict__:
        return None
    if native_kernels.unavailable() is not None or not _plain_norm(model.norm):
        return None
    isa = native_kernels.ISA_CODES[native_kernels.isa()]
    plan = torch.classes.gptforge_wo.DecodePlan()
    for blk in model.blocks:
        layer = _layer(blk)  # None for an MoE block (no linear1 / linear2)
        lins = [] if layer is None else [_linear(blk.get_submodule(p), linear_ops, isa) for p in BLOCK_LINEARS]
        if layer is None or any(x is None for x in lins):
            return None
        plan.add_layer(*layer)
        for args in lins:
            if args[0] == INT8:
                plan.add_int8_linear(*args[1:])
            else:
                plan.add_linear(*args)
    n = model.norm
    plan.set_final_norm(n.weight, n.bias, n.eps)
    return FusedDecode(plan, model)


def _hooked(mod: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in mod.modules())


def _plain(*ts) -> bool:
    """fp32 CPU tensors of no subclass (a DTensor shard would compute something else)."""
    return all(t is None or (type(t) in (torch.Tensor, nn.Parameter) and t.dtype == torch.float32 and t.is_cpu)
               for t in ts)


def _plain_norm(ln: nn.Module) -> bool:
    return (type(ln) is nn.LayerNorm and "forward" not in ln.__dict__ and ln.weight is not None
            and ln.bias is not None and len(ln.normalized_shape) == 1 and _plain(ln.weight, ln.bias))


def _layer(blk: nn.Module) -> tuple | None:
    """`DecodePlan.add_layer`'s arguments for a plain block, or None."""
    if type(blk) is not Block or blk.moe is not None or _hooked(blk) or "forward" in blk.__dict__:
        return None
    attn = blk.attn
    if type(attn) is not SelfAttention or "forward" in attn.__dict__ or type(blk.dropout) is not nn.Dropout:
        return None
    if not (_plain_norm(blk.norm1) and _plain_norm(blk.norm2)):
        return None
    act = getattr(blk, "act", None)  # the fused step runs csrc/gelu.cpp: only where the Python step does too
    if type(act) is not nn.GELU or act.__dict__.get("forward") is not native_kernels.gelu_forward:
        return None
    d = attn.head_dim
    qkv = attn.qkv_proj.out_features
    if qkv % (3 * d) or attn.out_proj.in_features != qkv // 3:
        return None
    return (blk.norm1.weight, blk.norm1.bias, blk.norm1.eps, blk.norm2.weight, blk.norm2.bias, blk.norm2.eps,
            qkv // (3 * d), d, d ** -0.5)  # the scale as RaggedBatch.attend computes it


def _linear(mod: nn.Module, linear_ops: dict, isa: int) -> tuple | None:
    """`DecodePlan.add_linear`'s arguments: `mod` run on one fp32 row as its forward runs it, or None."""
    if type(mod) is nn.Linear and _plain(mod.weight, mod.bias):
        entry = linear_ops.get(mod)
        if entry is not None:  # the backend's packed copies (`_packed_forward`)
            packed, gemv = entry
            if gemv is not None:
                return GEMV, gemv[0], None, None, mod.bias, None, mod.out_features, 0, native_kernels.ISA_CODES[gemv[1]]
            return PACKED, packed, None, None, mod.bias, None, mod.out_features, 0, 0
        if "forward" not in mod.__dict__:
            return PLAIN, mod.weight, None, None, mod.bias, None, mod.out_features, 0, 0
        return None
    if type(mod) is WeightOnlyLinear and not {"forward", "matmul"} & mod.__dict__.keys() and _plain(mod.bias):
        kern = mod.kernel_for(torch.empty(1, mod.in_features))  # the layer's own choice for one fp32 row
        if kern not in ("native", "native-q8a"):
            return None
        kind = WEIGHT_ONLY_Q8A if kern == "native-q8a" else WEIGHT_ONLY
        scale, zero = mod.native_operands()
        return (kind, mod.weight, scale, zero, mod.bias, getattr(mod, "act_scale", None), mod.out_features,
                mod.bits, isa)
    if type(mod) is Int8Linear and "forward" not in mod.__dict__ and mod.static_act and _plain(mod.bias):
        path = kernel_path(mod.kernel) if fast_kernel_available() else None
        if path != "native" and not (path == "plain" and _native_gives_plains_bits(mod)):
            return None  # fbgemm's paths (or the dequantized fallback) stay in Python
        step, clip = mod.static_grid()  # as Int8Linear.forward quantizes its input
        return INT8, mod.panels(), mod.weight_scale, mod.bias, mod.out_features, step, clip, isa
    return None


@torch.no_grad()
def _native_gives_plains_bits(mod: Int8Linear) -> bool:
    """Whether gptforge's int8 kernel gives fbgemm's one-call `plain` path's bits for this layer
    (where plain is exact, VNNI CPUs, both round and scale alike): then the fused step may run it
    while the Python step runs fbgemm. Checked on random rows over the layer's clip range, once per
    weights' version."""
    key = (mod.weight.data_ptr(), mod.weight._version, mod.weight_scale._version, mod.static_grid(),
           None if mod.bias is None else (mod.bias.data_ptr(), mod.bias._version))
    cached = mod.__dict__.get("_fused_plain_check")
    if cached is not None and cached[0] == key:
        return cached[1]
    ok = native_ready()
    if ok:
        step, clip = mod.static_grid()
        g = torch.Generator().manual_seed(mod.in_features * 7 + mod.out_features)
        x = ((torch.rand(5, mod.in_features, generator=g) * 2 - 1) * clip).clamp(-clip, clip)
        plain = mod(x)  # the layer's own forward on its `plain` path (x already within the clip)
        ok = torch.equal(native_kernels.int8_rows(x, mod.panels(), mod.weight_scale, mod.bias, step, mod.out_features),
                         plain)
    mod.__dict__["_fused_plain_check"] = (key, ok)
    return ok
