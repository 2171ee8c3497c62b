"""Weight-only low-bit layers: int8 / int4 (group-wise, packed two per byte) or bf16 weights,
float activations. A quantized model directory records its format in `weight_only.json`
(`WeightOnlySpec`); `model_io.load_model` rebuilds the structure from it (`apply_structure`).

Kernels (one choice per layer and call, `kernel_for`), forced with `GPTFORGE_WEIGHT_KERNEL`:

- `native`: gptforge's own C++ kernels (`transforms/native_kernels.py`, built once on first use) for
  int8 / int4 / bf16 layers, `NATIVE_MAX_ROWS` rows a call, up to `NATIVE_CHUNKED_ROWS` rows (decode,
  served steps, short prefills): the stored bytes read directly (bf16 widened to fp32 exactly, so on
  any CPU, no bf16 arithmetic), fp32 accumulation, AVX-512 / AVX2 / portable paths chosen from cpuid.
- `native-q8a` (opt-in, never `auto`): the same kernels with the activations rounded to int8 per 32
  columns, exact integer dot products (llama.cpp's q8 activations) for int8 / int4 groups of 32k
  columns: faster, not the float product (`native` for other layers, bf16 ones included).
- `packed`: PyTorch's `aten._weight_int8pack_mm` (int8, symmetric, per row) / `_weight_int4pack_mm_for_cpu`
  (int4, groups 32..256, rows a multiple of 16) where a one-time probe finds them exact on this CPU;
  int4 keeps a copy of its nibbles in the kernel's layout (built at the first call).
- `bf16`: dequantize to bf16 and `F.linear` in bf16, the default fallback where the CPU has
  native bf16 (oneDNN's check: AVX-512-bf16 or AMX).
- `fp32`: dequantize to fp32 and `F.linear` (every CPU). Nothing dequantized is cached.
`auto` (default): `native` where built and the call fits it, else `bf16` where native, else
`fp32` (`packed` only when forced: it is slower than `fp32` at every batch measured). bf16 weights
(`bits=16`) take `native` too; longer batches `bf16` where native (past 8 rows there), else `fp32` (a
bf16 -> fp32 copy per call). A forced `native` takes the `auto` path for calls it does not cover
(longer batches) and is a UsageError where the kernels cannot be built.
The packed kernels: 3-6x slower than fp32 `F.linear` at batch 1 (AVX-512, torch 2.13; issue #32).
A plan's head may keep rows at 8 bits (`weight_only_rows`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gptforge.errors import CheckpointError, UsageError
from gptforge.transforms import lowbit, native_kernels
from gptforge.transforms.cpu_kernels import probe_operands, requested_choice
from gptforge.transforms.weight_only_rows import MixedRowsEmbedding, row_slots

SPEC_FILE = "weight_only.json"
KERNEL_ENV = "GPTFORGE_WEIGHT_KERNEL"
KERNELS = ("auto", "native", "native-q8a", "packed", "bf16", "fp32")
NATIVE_MAX_ROWS = 8  # batch rows the native kernels take in one call (results/2026-11-25-lowbit-kernels.md)
# Rows up to which `auto` takes `native` in 8-row calls, by bits: dequantizing costs ~9 ns a weight per
# call (bf16: a copy; results/2026-11-27-gelu-attention-copies.md). Native bf16 CPUs: oneDNN past 8.
NATIVE_CHUNKED_ROWS = {4: 256, 8: 256, 16: 32}
INT4_PACK_GROUPS = (32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class WeightOnlySpec:
    """What a weight-only directory holds: block Linears at `bits` (4, 8 or 16 = bf16) in groups
    of `group_size` input columns (0: one per row), symmetric or not; the tied embedding / LM
    head at `head_bits` (4, 8, 16 = bf16, 32 = float as trained), same grouping. `layer_bits`
    ({block Linear name or `wte`: bits}, a mixed-precision plan) overrides both per layer."""

    bits: int = 4
    group_size: int = 64
    sym: bool = True
    head_bits: int = 8
    method: str = "rtn"  # rtn | gptq | awq (awq layers carry `act_scale`)
    clip: bool = False  # groups' ranges from `lowbit.clip_search`, not abs-max (how q was chosen; loads alike)
    layer_bits: dict[str, int] | None = dataclasses.field(default=None, hash=False)
    # token ids (ascending) of the head rows kept at 8 bits while the head is at 4 (a plan's
    # `MixedRowsEmbedding`); empty: the head is one table
    head_rows8: tuple[int, ...] = dataclasses.field(default=(), hash=False)

    def bits_for(self, name: str) -> int:
        """The bit-width of block Linear `name` or of `wte` (the tied embedding / head)."""
        default = self.head_bits if name == "wte" else self.bits
        return (self.layer_bits or {}).get(name, default)

    def apply(self, model: nn.Module) -> nn.Module:
        """The empty weight-only structure on `model` (`apply_structure`)."""
        return apply_structure(model, self)

    def dequantize(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Float weights of a state dict saved in this format (`dequantize_state_dict`)."""
        return dequantize_state_dict(sd, self)

    def save(self, d: Path, extra: dict | None = None) -> None:
        raw = {**dataclasses.asdict(self), **(extra or {}), "head_rows8": "@ROWS@"}
        rows = json.dumps(list(self.head_rows8), separators=(",", ":"))  # one line, however many rows
        text = json.dumps(raw, indent=2).replace('"@ROWS@"', rows)
        (Path(d) / SPEC_FILE).write_text(text + "\n")


def read_spec(d: str | Path) -> WeightOnlySpec | None:
    """The spec of a weight-only model directory; None for any other directory."""
    f = Path(d) / SPEC_FILE
    if not f.is_file():
        return None
    try:
        raw = json.loads(f.read_text(encoding="utf-8"))
        names = {fl.name for fl in dataclasses.fields(WeightOnlySpec)}
        spec = WeightOnlySpec(**{k: v for k, v in raw.items() if k in names})
        spec = dataclasses.replace(spec, head_rows8=tuple(spec.head_rows8))
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{f}: unreadable ({e}); copy it again from the quantized model") from None
    if spec.bits not in (4, 8, 16) or spec.head_bits not in (4, 8, 16, 32) or spec.group_size < 0:
        raise CheckpointError(f"{f}: bits {spec.bits} / head_bits {spec.head_bits} / group_size {spec.group_size} "
                              "not supported; the file is corrupted")
    bad = [f"{k}: {v}" for k, v in (spec.layer_bits or {}).items()
           if not isinstance(k, str) or v not in ((4, 8, 16, 32) if k == "wte" else (4, 8, 16))]
    if bad:
        raise CheckpointError(f"{f}: layer_bits {bad[0]} not supported; the file is corrupted")
    rows = spec.head_rows8
    if rows and (spec.bits_for("wte") != 4 or not all(isinstance(r, int) and r >= 0 for r in rows)
                 or any(a >= b for a, b in zip(rows, rows[1:], strict=False))):
        raise CheckpointError(f"{f}: head_rows8 must be ascending token ids of a 4-bit head (its rows kept at 8 "
                              "bits); the file is corrupted")
    return spec


# ----------------------------------------------------------------------- what this CPU runs


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """oneDNN computes bf16 natively here (AVX-512-bf16 / AMX); elsewhere bf16 is emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=2)
def packed_is_exact(bits: int) -> bool:
    """Whether the packed int8 / int4 CPU kernel exists and is exact here: integer-valued inputs,
    power-of-two scales, compared with integer arithmetic (fp32 sums stay below 2^24)."""
    q, w = probe_operands(8, 256, 32)
    x = torch.from_numpy(q).float()
    try:
        if bits == 8:
            s = torch.tensor([0.5, 1.0, 2.0, 4.0] * 8)
            y = torch.ops.aten._weight_int8pack_mm(x, torch.from_numpy(w).to(torch.int8), s)
            ref = (q @ w.T) * s.numpy().astype(np.float64)
        else:
            n = (w % 16).astype(np.int64)  # nibbles 0..15
            s = torch.tensor([0.5, 1.0, 2.0, 4.0] * 8)
            zf = torch.tensor([-3.0, 0.0, 5.0, 1.0] * 8)
            qsz = torch.stack([s.expand(8, 32), zf.expand(8, 32)], -1).contiguous()  # 256 / 32 groups
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(n).int(), 1), 32, qsz)
            wf = (n - 8) * s.numpy()[:, None] + zf.numpy()[:, None]
            ref = q @ wf.T
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(np.array_equal(y.double().numpy(), ref))


def requested_kernel(arg: str | None = None) -> str:
    return requested_choice(arg, KERNEL_ENV, KERNELS, "kernel")


# ----------------------------------------------------------------------- modules


class WeightOnlyLinear(nn.Module):
    """y = x · dequant(W)ᵀ + b with W stored as int8, packed int4 or bf16 (`weight`), fp32
    `weight_scale` [out, groups] and, when asymmetric, int8 `weight_zero` [out, groups]. With
    `act_scale` (AWQ) the stored weight is W · diag(s) and the input is divided by s first."""

    kernel: str | None = None  # None/auto: $GPTFORGE_WEIGHT_KERNEL, else the probe's choice

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, bits: int = 4,
                 group_size: int = 0, sym: bool = True, act_scale: bool = False, device=None):
        super().__init__()
        g = group_size or in_features
        if in_features % g or (bits == 4 and in_features % 2):
            raise ValueError(f"{in_features} input columns do not split into groups of {g}")
        self.in_features, self.out_features, self.bits, self.sym = in_features, out_features, bits, sym
        self.group_size = group_size if group_size and group_size < in_features else 0
        cols, dt = {4: (in_features // 2, torch.uint8), 8: (in_features, torch.int8),
                    16: (in_features, torch.bfloat16)}[bits]
        self.register_buffer("weight", torch.zeros(out_features, cols, dtype=dt, device=device))
        if bits < 16:
            self.register_buffer("weight_scale", torch.ones(out_features, in_features // g, device=device))
            if not sym:
                self.register_buffer("weight_zero", torch.zeros(out_features, in_features // g, dtype=torch.int8,
                                                                device=device))
        if act_scale:
            self.register_buffer("act_scale", torch.ones(in_features, device=device))
        self._awq = act_scale  # a plain attribute: `hasattr` on a module costs a raised AttributeError per call
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None
        self._kernel_weight, self._kernel_key = None, None
        self._kernel_choice: dict[tuple, str] = {}

    @classmethod
    @torch.no_grad()
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int, sym: bool,
                   quantized=None, act_scale: torch.Tensor | None = None, clip: bool = False) -> WeightOnlyLinear:
        """A layer holding `w` [out, in] rounded to nearest (`clip`: on the clip search's grid), or
        `quantized` = (q, scale, zero) (GPTQ); with `act_scale` s (AWQ), w · diag(s) rounded."""
        mod = cls(w.shape[1], w.shape[0], bias=bias is not None, bits=bits, group_size=group_size, sym=sym,
                  act_scale=act_scale is not None, device=w.device)
        if bias is not None:
            mod.bias.copy_(bias.float())
        if act_scale is not None:
            mod.act_scale.copy_(act_scale.float())
            w = w.float() * act_scale.float()
        if bits == 16:
            mod.weight.copy_(w.to(torch.bfloat16))
            return mod
        q, scale, zero = quantized if quantized is not None else lowbit.quantize_rtn(w, bits, group_size, sym, clip)
        mod.weight.copy_(lowbit.pack_int4(q) if bits == 4 else q.to(torch.int8))
        mod.weight_scale.copy_(scale.float())
        if not sym:
            mod.weight_zero.copy_(zero.to(torch.int8))
        return mod

    def ints(self) -> torch.Tensor:
        """The integer weights [out, in] (int8 tensor)."""
        return lowbit.unpack_int4(self.weight) if self.bits == 4 else self.weight

    def zeros(self) -> torch.Tensor:
        return self.weight_zero if not self.sym else torch.zeros_like(self.weight_scale)

    def _stored(self, dtype: torch.dtype) -> torch.Tensor:
        if self.bits == 16:
            return self.weight.to(dtype)
        return lowbit.dequantize(self.ints(), self.weight_scale, self.zeros(), self.group_size, dtype)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight the layer computes with (AWQ's input scale folded back in)."""
        w = self._stored(torch.float32)
        return (w / self.act_scale if hasattr(self, "act_scale") else w).to(dtype)

    def kernel_for(self, x: torch.Tensor) -> str:
        """`native`, `native-q8a`, `packed`, `bf16` or `fp32`: this call's path (module docstring), kept
        per layer for what decides it (forcing variables, row limits, dtype, device): ~10 us a choice."""
        env = os.environ
        rows = x.shape[0]
        key = (self.kernel, env.get(KERNEL_ENV), env.get(native_kernels.ISA_ENV),
               rows <= NATIVE_MAX_ROWS, rows <= NATIVE_CHUNKED_ROWS.get(self.bits, 0), x.dtype, x.is_cpu)
        got = self._kernel_choice.get(key)
        if got is None:
            got = self._kernel_choice[key] = self._choose_kernel(x)
        return got

    def _choose_kernel(self, x: torch.Tensor) -> str:
        req = requested_kernel(self.kernel)
        if req.startswith("native"):
            why = native_kernels.unavailable()
            if why:
                raise UsageError(f"{KERNEL_ENV}={req}: gptforge's CPU kernels are unavailable here ({why}); "
                                 "unset it to use the built-in kernels")
        fits = self._native_fits(x)
        if req == "native-q8a" and fits and self.bits < 16 and (self.group_size or self.in_features) % 32 == 0:
            return "native-q8a"
        if (req == "auto" or req.startswith("native")) and fits and not native_kernels.unavailable():
            return "native"
        # Only when forced: PyTorch's packed kernels are exact here but slower than dequantize + F.linear
        # at every batch (AMD EPYC, torch 2.13, 768x3072: int4 3.4x at 16 rows, 29x at 128; int8 4.5x, 35x).
        if req == "packed" and self._packable(x) and packed_is_exact(self.bits):
            return "packed"
        if req == "fp32" or (req != "bf16" and not native_bf16()):
            return "fp32"
        return "bf16"

    def _native_fits(self, x: torch.Tensor) -> bool:
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return False
        rows = NATIVE_MAX_ROWS if self.bits == 16 and native_bf16() else NATIVE_CHUNKED_ROWS.get(self.bits, 8)
        return x.shape[0] <= rows and (self.bits != 4 or (self.group_size or self.in_features) % 2 == 0)

    def native_operands(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(scale, zero) as the native kernels take them: None for what the format has not (bf16:
        neither; symmetric: no zero)."""
        if self.bits == 16:
            return None, None
        return self.weight_scale, None if self.sym else self.weight_zero

    def _packable(self, x: torch.Tensor) -> bool:
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return False
        if self.bits == 8:
            return self.sym and self.group_size == 0
        return self.bits == 4 and self.group_size in INT4_PACK_GROUPS and self.out_features % 16 == 0

    def _int4_kernel_weight(self):
        key = (self.weight.data_ptr(), self.weight._version, self.weight_scale._version)
        if self._kernel_weight is None or key != self._kernel_key:
            nib = (self.ints().int() + 8)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nib, 1)
            zf = -self.zeros().float() * self.weight_scale  # (n - 8)·s + zf = (q - zero)·s
            qsz = torch.stack([self.weight_scale.t(), zf.t()], -1).contiguous()
            self._kernel_weight, self._kernel_key = (packed, qsz), key
        return self._kernel_weight

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x · dequant(W)ᵀ (+ `bias`) on the chosen kernel."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self._awq:
            x2 = x2 / self.act_scale.to(x2.dtype)
        kern = self.kernel_for(x2)
        if kern.startswith("native"):  # fp32 in and out (`_native_fits`), NATIVE_MAX_ROWS rows a call
            ops, q8 = (self.weight, *self.native_operands(), bias, self.bits), kern == "native-q8a"
            ys = [native_kernels.weight_only_linear(c, *ops, q8_activations=q8) for c in x2.split(NATIVE_MAX_ROWS)]
            return (ys[0] if len(ys) == 1 else torch.cat(ys)).view(*shape[:-1], self.out_features)
        if kern == "packed" and self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight, self.weight_scale[:, 0])
        elif kern == "packed":
            packed, qsz = self._int4_kernel_weight()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), packed, self.group_size, qsz)
        elif kern == "bf16":
            y = F.linear(x2.to(torch.bfloat16), self._stored(torch.bfloat16)).to(x.dtype)
        else:
            y = F.linear(x2.float(), self._stored(torch.float32)).to(x.dtype)
        y = y.reshape(*shape[:-1], self.out_features)
        return y + bias.to(y.dtype) if bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def extra_repr(self) -> str:
        fmt = "bf16" if self.bits == 16 else (f"int{self.bits} {'sym' if self.sym else 'asym'} "
                                              f"{'group ' + str(self.group_size) if self.group_size else 'per row'}")
        return f"{self.in_features}, {self.out_features}, {fmt}"


class WeightOnlyEmbedding(WeightOnlyLinear):
    """The tied word embedding / LM head in the weight-only format: lookup dequantizes the rows
    it reads; `project` is the head's matrix product on the layer's kernel."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, bits: int = 8, group_size: int = 0,
                 sym: bool = True, device=None):
        super().__init__(embedding_dim, num_embeddings, bias=False, bits=bits, group_size=group_size, sym=sym,
                         device=device)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.weight[flat]
        if self.bits == 16:
            out = rows.float()
        else:
            q = lowbit.unpack_int4(rows) if self.bits == 4 else rows
            scale = self.weight_scale[flat]
            # only the rows read: a symmetric head's zeros for the whole vocabulary cost a 2 MB memset per step
            zero = torch.zeros_like(scale) if self.sym else self.weight_zero[flat]
            out = lowbit.dequantize(q, scale, zero, self.group_size)
        return out.reshape(*ids.shape, self.embedding_dim)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.matmul(hidden)


# ----------------------------------------------------------------------- whole models


def check_shapes(model: nn.Module, spec: WeightOnlySpec) -> None:
    """ConfigError naming the layer whose input columns the group size does not divide."""
    from gptforge.errors import ConfigError
    from gptforge.model.gpt import block_linears

    g = spec.group_size
    cols = [(n, lin.in_features) for n, lin in block_linears(model)] + [("wte (embedding / head)",
                                                                        model.wte.embedding_dim)]
    for name, k in cols:
        if g and k % g or k % 2:
            raise ConfigError(f"--group-size {g}: {name} has {k} input columns, not a multiple of "
                              f"{g or 2}; choose a group size that divides the hidden and FFN sizes")


def install_embedding(model: nn.Module, emb: WeightOnlyEmbedding) -> None:
    from gptforge.transforms.int8 import _install_int8_embedding  # the head + float-KV-cache rewiring

    _install_int8_embedding(model, emb)


def apply_structure(model: nn.Module, spec: WeightOnlySpec) -> nn.Module:
    """Give a float model (typically on the meta device) the empty weight-only structure of a
    directory saved with `spec`, so its state dict loads with `load_state_dict(assign=True)`."""
    from gptforge.model.gpt import block_linears

    dev = model.wte.weight.device
    for name, lin in block_linears(model):
        bits = spec.bits_for(name)
        model.set_submodule(name, WeightOnlyLinear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                           bits=bits, group_size=spec.group_size, sym=spec.sym,
                                           act_scale=spec.method == "awq" and bits < 16, device=dev))
    if spec.bits_for("wte") < 32:
        install_embedding(model, _head_structure(model.wte.num_embeddings, model.wte.embedding_dim, spec, dev))
    return model


def _head_structure(vocab: int, dim: int, spec: WeightOnlySpec, device) -> nn.Module:
    """The empty weight-only head of `spec`: one table, or 8-bit rows `head_rows8` beside 4-bit ones."""
    bits, rows = spec.bits_for("wte"), spec.head_rows8
    if not rows:
        return WeightOnlyEmbedding(vocab, dim, bits=bits, group_size=spec.group_size, sym=spec.sym, device=device)
    if rows[-1] >= vocab or len(rows) >= vocab:
        raise CheckpointError(f"{SPEC_FILE}: head_rows8 names rows up to {rows[-1]} ({len(rows)} rows) of a "
                              f"{vocab}-row head; the file belongs to another model")
    parts = [WeightOnlyEmbedding(n, dim, bits=b, group_size=spec.group_size, sym=spec.sym, device=device)
             for n, b in ((len(rows), 8), (vocab - len(rows), bits))]
    return MixedRowsEmbedding(*parts, torch.tensor(rows, dtype=torch.long))


@torch.no_grad()
def quantize_layer(model: nn.Module, name: str, spec: WeightOnlySpec, quantized=None,
                   act_scale: torch.Tensor | None = None, rounder=None) -> None:
    """Swap block Linear `name` (or `wte`, the tied embedding / head) for its weight-only form:
    rounded to nearest, or the given (q, scale, zero), or by `rounder(w, bits)` -> (q, scale, zero)
    (GPTQ; it also rounds each table of a `head_rows8` head on its own: rows round
    independently), or AWQ's `act_scale` then rounded."""
    bits = spec.bits_for(name)
    if name == "wte":
        if bits == 32:
            return
        emb = model.wte
        w = emb.weight.detach()
        new = _head_structure(emb.num_embeddings, emb.embedding_dim, spec, w.device)
        parts = ((new, w, bits),)
        if spec.head_rows8:
            if quantized is not None:
                raise ValueError("a head of two tables is rounded by `rounder`, not by one (q, scale, zero)")
            hot = torch.zeros(len(w), dtype=torch.bool, device=w.device)
            hot[list(spec.head_rows8)] = True
            parts = ((new.hot, w[hot], 8), (new.cold, w[~hot], bits))
        for part, rows, b in parts:
            got = quantized if quantized is not None else rounder(rows.float(), b) if rounder and b < 16 else None
            part.load_state_dict(WeightOnlyLinear.from_float(rows, None, b, spec.group_size, spec.sym,
                                                             got, clip=spec.clip).state_dict())
        install_embedding(model, new)
        return
    lin = model.get_submodule(name)
    if rounder is not None and quantized is None and bits < 16:
        quantized = rounder(lin.weight.detach().float(), bits)
    model.set_submodule(name, WeightOnlyLinear.from_float(lin.weight.detach(), lin.bias, bits, spec.group_size,
                                                  spec.sym, quantized, act_scale, clip=spec.clip))


def quantize_rtn_model(model: nn.Module, spec: WeightOnlySpec, grids: dict | None = None) -> nn.Module:
    """Round every block Linear and the embedding / head to nearest (or onto `grids[name]`, a
    (q, scale, zero) such as a QAT model learned), in place."""
    from gptforge.model.gpt import block_linears

    check_shapes(model, spec)
    for name in [n for n, _ in block_linears(model)] + ["wte"]:
        quantize_layer(model, name, spec, (grids or {}).get(name))
    return model


def dequantize_state_dict(sd: dict[str, torch.Tensor], spec: WeightOnlySpec) -> dict[str, torch.Tensor]:
    """Float weights of a weight-only state dict, for loading into a plain float model."""
    out = {}
    for k, v in sd.items():
        if k.endswith((".weight_scale", ".weight_zero", ".act_scale")):
            continue
        if k.endswith(".weight") and k[: -len("weight")] + "weight_scale" in sd or v.dtype == torch.bfloat16:
            p = k[: -len("weight")]
            bits = 16 if v.dtype == torch.bfloat16 else 4 if v.dtype == torch.uint8 else 8
            if bits == 16:
                v = v.float()
            else:
                q = lowbit.unpack_int4(v) if bits == 4 else v
                s = sd[p + "weight_scale"]
                z = sd.get(p + "weight_zero", torch.zeros_like(s))
                v = lowbit.dequantize(q, s, z, q.shape[1] // s.shape[1])
            if p + "act_scale" in sd:
                v = v / sd[p + "act_scale"]
        out[k] = v
    if spec.head_rows8 and "wte.hot.weight" in out:  # a head of two tables: rows back in token order
        w = torch.cat([out.pop("wte.hot.weight"), out.pop("wte.cold.weight")])
        out["wte.weight"] = w.index_select(0, row_slots(torch.tensor(spec.head_rows8), len(w)))
    return out


def planned_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers a bit-width plan chooses for, in model order: every block Linear, then `wte`
    (the tied embedding / LM head)."""
    from gptforge.model.gpt import block_linears

    return [*block_linears(model), ("wte", model.wte)]


def stored_bytes(in_features: int, out_features: int, bits: int, spec: WeightOnlySpec, *, bias: bool = False,
                 head: bool = False) -> int:
    """Bytes a weight-only layer of this shape holds at `bits` with `spec`'s grouping (weight,
    scales, zeros, AWQ's input scale, bias); 32 bits: the float weight (and bias). `head`: the
    tied embedding, which AWQ does not scale."""
    if bits == 32:
        return 4 * (in_features * out_features + (out_features if bias else 0))
    m = WeightOnlyLinear(in_features, out_features, bias=bias, bits=bits, group_size=spec.group_size, sym=spec.sym,
                         act_scale=spec.method == "awq" and bits < 16 and not head, device="meta")
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())


def weight_only_layers(model: nn.Module) -> list[tuple[str, WeightOnlyLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, WeightOnlyLinear)]

