"""INT8 models in QDQ form: what the reference's `onnx_format` export writes (spec §8.3).

Each quantized Linear becomes

    x -> Clip(±c) -> QuantizeLinear(step_x, z) -> DequantizeLinear(step_x, z) -> MatMul(., DQ(W_q, s_w, z_w)) + b

- `step_x` is the learned static activation step (act_scale / qmax) of the fake-quant layer;
  `abs_max` activations, which have no stored scale, get their step computed in the graph
  (max|x| / qmax per call), as the fake-quant layer computes it;
- `c = min(qmax·step_x, alpha)`: the symmetric ±qmax range and, where it binds, the PACT clip.
  The reference drops PACT at export; when alpha is below the quantizer's range that changes
  the numbers, so the clip is kept (a no-op otherwise);
- `W_q` is stored [in, out] with one step per output column (`axis=1`) or one per tensor:
  exactly the integers the fake-quant forward uses;
- a quantized tied embedding (`quantize_embedding`) is stored as its dequantized fp32 values
  (int8 rows x their steps: the same numbers; why: `to_qdq`).

Encoding (`dtype`). The integers are symmetric (±127 for 8 bits). `int8` stores them as they
are, with zero point 0 (the reference's form). `uint8` (the default) stores them + 128 with
zero point 128: the same numbers after dequantization, but onnxruntime then fuses each
MatMul into its u8·u8 int8 GEMM, which widens to 16 bits and is exact on every x86 CPU we
probed; its s8 path on x86 without VNNI adds pairs of products into saturating int16
(`vpmaddubsw`) and is off by ~15% of a layer's output range (measured on AVX2: docs/export.md).
`auto` picks the fastest encoding whose fused kernel a one-time probe finds exact on the
exporting CPU (`transforms/cpu_kernels.py`): int8 where the s8 kernel is exact (VNNI), else
uint8. The file outlives that CPU, hence uint8, exact wherever it runs, stays the default.

The two custom ops below (`gptforge::quantize_dequantize`, `gptforge::dequantize_weight`)
compute these numbers in eager PyTorch (so a QDQ module equals the fake-quant model), stay
single nodes through `torch.export`, and become ONNX QuantizeLinear/DequantizeLinear through
`onnx_translations()`. A `.pt2` program holding them needs `import gptforge.export.qdq`
(done by `load_program`) to load.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from gptforge.errors import UsageError
from gptforge.transforms.quant import EPS, qmax_for

QDQ_DTYPES = ("uint8", "int8", "auto")
_OFFSET = {"uint8": 128, "int8": 0}
_TORCH_DTYPE = {"uint8": torch.uint8, "int8": torch.int8}


@torch.library.custom_op("gptforge::quantize_dequantize", mutates_args=())
def quantize_dequantize(x: torch.Tensor, step: torch.Tensor, clip: torch.Tensor,
                        zero_point: torch.Tensor) -> torch.Tensor:
    """clamp(x, ±clip), then round half to even to multiples of `step`. `zero_point` only
    names the stored encoding: within ±127 steps uint8/128 and int8/0 hold the same numbers."""
    del zero_point
    xc = torch.minimum(torch.maximum(x, -clip), clip)
    return torch.fake_quantize_per_tensor_affine(xc, float(step), 0, -128, 127)


@quantize_dequantize.register_fake
def _(x, step, clip, zero_point):
    return torch.empty_like(x)


@torch.library.custom_op("gptforge::dequantize_weight", mutates_args=())
def dequantize_weight(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    """(w - zero_point) x its step (0-d `scale`: per tensor; 1-d: along `axis`), in scale's dtype."""
    q = w.to(torch.int32) - zero_point.to(torch.int32).reshape(_bshape(w, zero_point, axis))
    return q.to(scale.dtype) * scale.reshape(_bshape(w, scale, axis))


def _bshape(w: torch.Tensor, t: torch.Tensor, axis: int) -> list[int]:
    if t.dim() == 0:
        return []
    shape = [1] * w.dim()
    shape[axis] = -1
    return shape


@dequantize_weight.register_fake
def _(w, scale, zero_point, axis):
    return torch.empty(w.shape, dtype=scale.dtype, device=w.device)


def _onnx_quantize_dequantize(x, step, clip, zero_point):
    from onnxscript import opset18 as op

    xc = op.Clip(x, op.Neg(clip), clip)
    return op.DequantizeLinear(op.QuantizeLinear(xc, step, zero_point), step, zero_point)


def _onnx_dequantize_weight(w, scale, zero_point, axis: int):
    from onnxscript import opset18 as op

    return op.DequantizeLinear(w, scale, zero_point, axis=axis)


def onnx_translations() -> dict:
    """`custom_translation_table` for `torch.onnx.export` (ONNX opset 18)."""
    return {torch.ops.gptforge.quantize_dequantize.default: _onnx_quantize_dequantize,
            torch.ops.gptforge.dequantize_weight.default: _onnx_dequantize_weight}


def resolve_qdq_dtype(dtype: str) -> str:
    """`uint8` or `int8`: `dtype` itself, or for `auto` the fastest exact one here (module docstring)."""
    if dtype not in QDQ_DTYPES:
        raise UsageError(f"--qdq-dtype {dtype!r}: choose one of {', '.join(QDQ_DTYPES)}")
    if dtype == "auto":
        from gptforge.transforms.cpu_kernels import fastest_exact_qdq_dtype

        return fastest_exact_qdq_dtype()
    return dtype


def _encode(ints: torch.Tensor, dtype: str) -> torch.Tensor:
    return (ints.to(torch.int16) + _OFFSET[dtype]).to(_TORCH_DTYPE[dtype])


def _zero_point(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    return torch.full(shape, _OFFSET[dtype], dtype=_TORCH_DTYPE[dtype])


class QDQLinear(nn.Module):
    """A quantized Linear in QDQ form (see the module docstring); built from an `Int8Linear`."""

    def __init__(self, src, dtype: str = "uint8") -> None:
        super().__init__()
        qm = qmax_for(src.act_bits)
        self.qmax = qm
        per_channel = src.weight_scale.numel() > 1
        self.axis = 1 if per_channel else 0
        s = src.weight_scale.detach().float()
        scale = s.clone() if per_channel else s.reshape(()).clone()
        self.register_buffer("weight", _encode(src.weight.detach().t().contiguous(), dtype))  # [in, out]
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero_point", _zero_point(tuple(scale.shape), dtype))
        self.register_buffer("bias", src.bias.detach().float().clone() if src.bias is not None else None)
        self.register_buffer("zero_point", _zero_point((), dtype))
        alpha = float(src.pact_alpha.reshape(())) if src.pact_alpha is not None else math.inf
        self.alpha = alpha
        if src.input_scale is not None:  # static step
            step = float(src.input_scale.reshape(()))
            self.register_buffer("step", torch.tensor(step))
            self.register_buffer("clip", torch.tensor(min(qm * step, alpha)))
        else:
            self.register_buffer("step", None)
            self.register_buffer("clip", None)
        self.in_features, self.out_features = src.in_features, src.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step is not None:
            step, clip = self.step, self.clip
        else:  # abs_max activations: this call's (PACT-clipped) max|x|
            amax = x.detach().abs().max()
            if math.isfinite(self.alpha):
                amax = amax.clamp_max(self.alpha)
            step = (amax / self.qmax).clamp_min(EPS)
            clip = step * self.qmax
        xq = torch.ops.gptforge.quantize_dequantize(x, step, clip, self.zero_point)
        w = torch.ops.gptforge.dequantize_weight(self.weight, self.weight_scale, self.weight_zero_point, self.axis)
        y = torch.matmul(xq, w)
        return y + self.bias if self.bias is not None else y


@torch.no_grad()
def to_qdq(model: nn.Module, dtype: str = "uint8") -> nn.Module:
    """A copy of a fake-quant (QAT/PTQ) or converted INT8 model with QDQ modules in place of
    the quantized ones; eval-mode numerics are those of the fake-quant model. `dtype`: how
    the integers are stored (see the module docstring)."""
    from gptforge.export.common import FAKE_QUANT, model_kind
    from gptforge.transforms.int8 import Int8Embedding, Int8Linear, convert_model

    dtype = resolve_qdq_dtype(dtype)
    m = copy.deepcopy(model).eval()
    if model_kind(m) == FAKE_QUANT:
        convert_model(m)  # the exact integers and steps, checked and shared with `quantize --convert`
    for name, mod in list(m.named_modules()):
        if isinstance(mod, Int8Linear):
            m.set_submodule(name, QDQLinear(mod, dtype))
    if isinstance(m.wte, Int8Embedding):
        # Stored dequantized (the same values): onnxruntime does not fold DequantizeLinear of an
        # initializer, so an int8 table would be dequantized whole at every step for the head,
        # whose input is not quantized and so gets no int8 GEMM anyway.
        emb = nn.Embedding(m.wte.num_embeddings, m.wte.embedding_dim, device="meta")
        emb.weight = nn.Parameter(m.wte.dequantized_weight(), requires_grad=False)
        m.wte = emb
        m.__dict__.pop("logits", None)  # back to the class's float head
    return m
