"""Group-wise low-bit weight math shared by round-to-nearest, GPTQ and the weight-only modules.

Integers are signed, q in [-2^(b-1), 2^(b-1) - 1], and a weight is (q - zero) · scale, with one
scale (and zero) per output row and group of `group_size` consecutive input columns (0: the
whole row). Symmetric: zero = 0, scale = max|w| / (2^(b-1) - 1). Asymmetric: the group's
[min, max] (stretched to hold 0) spans the 2^b levels, zero an integer in the same range.
int4 is stored two per byte: column 2j in the low nibble, 2j+1 in the high one, as q + 8.
"""

from __future__ import annotations

import torch

EPS = 1e-12


def qrange(bits: int) -> tuple[int, int]:
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def group_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [rows], zero [rows]) for the columns of `w` [rows, cols] as one group."""
    lo_q, hi_q = qrange(bits)
    if sym:
        scale = (w.abs().amax(dim=1) / hi_q).clamp_min(EPS)
        return scale, torch.zeros_like(scale)
    lo = w.amin(dim=1).clamp_max(0)
    hi = w.amax(dim=1).clamp_min(0)
    scale = ((hi - lo) / (hi_q - lo_q)).clamp_min(EPS)
    zero = (torch.round(-lo / scale) + lo_q).clamp(lo_q, hi_q)
    return scale, zero


def quantize_cols(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers (as floats) of the columns `w` [rows, n] with one (scale, zero) per row."""
    lo_q, hi_q = qrange(bits)
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    return (torch.round(w / s) + z).clamp(lo_q, hi_q)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - zero) · scale of integers q [rows, cols] with per-group scale / zero [rows, groups]."""
    rows, cols = q.shape
    g = group_size or cols
    qf = q.to(dtype).reshape(rows, cols // g, g)
    return ((qf - zero.to(dtype).unsqueeze(-1)) * scale.to(dtype).unsqueeze(-1)).reshape(rows, cols)


def rtn_grid(w: torch.Tensor, bits: int, group_size: int, sym: bool, clip: bool = False):
    """Round-to-nearest: (q [rows, cols] as fp32 integers, scale fp32 [rows, groups], zero [rows, groups])
    on each group's abs-max grid, or with `clip` on `clip_search`'s."""
    rows, cols = w.shape
    g = group_size or cols
    wg = w.float().reshape(rows * (cols // g), g)
    if clip:
        scale, zero = (t.reshape(-1) for t in clip_search(w, bits, group_size, sym))
    else:
        scale, zero = group_params(wg, bits, sym)
    q = quantize_cols(wg, scale, zero, bits)
    return q.reshape(rows, cols), scale.reshape(rows, -1), zero.reshape(rows, -1)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool, clip: bool = False):
    """Round-to-nearest: (q int8 [rows, cols], scale fp32 [rows, groups], zero [rows, groups]);
    `clip`: on `clip_search`'s grid."""
    q, scale, zero = rtn_grid(w, bits, group_size, sym, clip)
    return q.to(torch.int8), scale, zero


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """`w` rounded to nearest on `quantize_rtn`'s grid and dequantized (fp32, the very numbers a
    weight-only layer holding `quantize_rtn(w)` computes with); bits 16: the bf16 cast. The
    gradient is the straight-through estimator: identity to `w` (min / max grids clip nothing),
    none to the scales. Adding `w - w.detach()` (exactly 0) keeps the forward bit-exact."""
    wd = w.detach()
    if bits == 16:
        fq = wd.to(torch.bfloat16).float()
    else:
        q, scale, zero = rtn_grid(wd, bits, group_size, sym)
        fq = dequantize(q, scale, zero, group_size)
    return fq + (w.float() - wd.float())


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 values [rows, cols] (cols even) -> uint8 [rows, cols / 2], two per byte."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: int8 values in [-8, 7], [rows, 2 · bytes]."""
    lo = (packed & 0x0F).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(21))  # 1.0 down to 0.5


def clip_search(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [rows, groups], zero [rows, groups]) of each group's range shrunk by the ratio in
    `CLIP_RATIOS` whose rounding error (squared) is smallest: clipping a few large weights buys
    finer steps for the rest. Ratio 1 is round-to-nearest's own grid, so no group does worse."""
    rows, cols = w.shape
    g = group_size or cols
    wg = w.detach().float().reshape(rows * (cols // g), g)
    best = scale = zero = None
    for r in CLIP_RATIOS:
        s, z = group_params(wg * r, bits, sym)
        err = (dequantize(quantize_cols(wg, s, z, bits), s.unsqueeze(-1), z.unsqueeze(-1), 0) - wg).square().sum(1)
        if best is None:
            best, scale, zero = err, s, z
        else:
            better = err < best
            best, scale, zero = (torch.where(better, err, best), torch.where(better, s, scale),
                                 torch.where(better, z, zero))
    return scale.reshape(rows, -1), zero.reshape(rows, -1)


class _RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def learned_grid(w: torch.Tensor, log_scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int):
    """(q [rows, cols] as fp32 integers, scale fp32 [rows, groups]) of `w` on the grid of the given
    per-group scales exp(log_scale) and integer zeros; differentiable (LSQ, Esser et al. 2020):
    rounding passes the gradient straight through, the clamp does not (a clipped weight's
    gradient goes to its group's scale)."""
    rows, cols = w.shape
    g = group_size or cols
    lo_q, hi_q = qrange(bits)
    scale = log_scale.float().exp()
    wg = w.float().reshape(rows, cols // g, g)
    q = (_RoundSTE.apply(wg / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(lo_q, hi_q)
    return q.reshape(rows, cols), scale


def fake_quantize_learned(w: torch.Tensor, log_scale: torch.Tensor, zero: torch.Tensor, bits: int,
                          group_size: int) -> torch.Tensor:
    """`w` on its learned grid (`learned_grid`), dequantized: the numbers `dequantize` gives for
    the same integers and scales, so a converted model computes them exactly."""
    q, scale = learned_grid(w, log_scale, zero, bits, group_size)
    return dequantize(q, scale, zero, group_size)
