"""GPTQ (Frantar et al. 2022, arXiv:2210.17323): quantize a Linear's weight column by column,
spreading each column's rounding error over the columns not yet quantized through the inverse
Hessian of the layer's least-squares objective, H = 2·XXᵀ over calibration inputs X.

`gptq_quantize(W, H, ...)` is one layer: dampening (λ = damp · mean diag H), the upper
Cholesky factor of H⁻¹, column-wise quantization with error feedback, lazy batch updates of
the remaining columns (blocks of 128), and group-wise (scale, zero) chosen from the current,
error-updated weights when a group's first column is reached. `act_order` quantizes columns
by decreasing diag H with groups fixed from the original weights beforehand ("static groups",
so the stored groups stay contiguous).

`gptq_model(model, spec, batches)` runs it block by block: every block Linear's H comes from
its inputs in the partly quantized model (blocks before it already quantized), then the block
is quantized and its outputs feed the next one; the tied LM head last, from the final norm,
with a stronger dampening (`HEAD_DAMP`, see `damp_for`).
"""

from __future__ import annotations

import torch
from torch import nn

from gptforge.transforms import lowbit
from gptforge.transforms.weight_only import WeightOnlySpec, quantize_layer

# The tied head is also the input embedding. Its Hessian sees only the output use, and moving a
# row's rounding error onto the row's other columns (which the lookup reads unweighted) costs
# more at the input than it saves in the logits: at 0.01 GPTQ's 4-bit head did worse than rounding
# to nearest on a 6000-step model. A dampening of half H's mean diagonal pulls the solution toward
# plain rounding; on three trained models it came within 9% of the best of 0.01 ... 10 and
# round to nearest (benchmarks/results/2026-11-27-tied-head-gptq.md).
HEAD_DAMP = 0.5


def damp_for(name: str, damp: float) -> float:
    """GPTQ dampening of layer `name`: `damp`, and at least `HEAD_DAMP` for the tied head `wte`."""
    return max(damp, HEAD_DAMP) if name == "wte" else damp


def _cholesky_inverse_upper(H: torch.Tensor, damp: float) -> torch.Tensor:
    H = H.clone()
    H.diagonal().add_(damp * H.diagonal().mean())
    L = torch.linalg.cholesky(H)
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)


def _group_params(w: torch.Tensor, bits: int, sym: bool, clip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [rows], zero [rows]) of the columns `w` as one group: abs-max, or the clip search's."""
    if not clip:
        return lowbit.group_params(w, bits, sym)
    scale, zero = lowbit.clip_search(w, bits, 0, sym)
    return scale[:, 0].to(w.dtype), zero[:, 0].to(w.dtype)


def _static_groups(W: torch.Tensor, bits: int, g: int, sym: bool, clip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    cols = W.shape[1]
    sz = [_group_params(W[:, i:i + g], bits, sym, clip) for i in range(0, cols, g)]
    return torch.stack([s for s, _ in sz], 1), torch.stack([z for _, z in sz], 1)


@torch.no_grad()
def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int, group_size: int = 0, sym: bool = True,
                  damp: float = 0.01, block: int = 128, act_order: bool = False, clip: bool = False):
    """(q int8 [out, in], scale [out, groups], zero [out, groups]) for weight `W` [out, in]
    and Hessian `H` [in, in]; computed in W's dtype (float32, or float64 for references).
    `clip`: each group's grid from `lowbit.clip_search` of the (error-updated) weights, not abs-max."""
    W = W.clone()
    rows, cols = W.shape
    g = group_size or cols
    H = H.to(W.dtype).clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    fixed = _static_groups(W, bits, g, sym, clip) if act_order or g == cols else None
    perm = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(cols)
    W, H = W[:, perm], H[perm][:, perm]
    Hinv = _cholesky_inverse_upper(H, damp)
    block = max(g, block - block % g) if g < cols else block
    Q = torch.zeros_like(W)
    scale = torch.zeros(rows, cols // g, dtype=W.dtype)
    zero = torch.zeros_like(scale)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            grp = col // g
            if fixed is None and (i1 + i) % g == 0:  # a group's first column: its params from the updated W
                scale[:, grp], zero[:, grp] = _group_params(W1[:, i:i + g], bits, sym, clip)
            elif fixed is not None:
                scale[:, grp], zero[:, grp] = fixed[0][:, grp], fixed[1][:, grp]
            q = lowbit.quantize_cols(W1[:, i:i + 1], scale[:, grp], zero[:, grp], bits)[:, 0]
            Q[:, i1 + i] = q
            err = (W1[:, i] - (q - zero[:, grp]) * scale[:, grp]) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]  # the lazy batch update of the columns after the block
    q = torch.empty_like(Q)
    q[:, perm] = Q
    return q.to(torch.int8), scale.float(), zero.float()


class _Hessian:
    """Running H = 2/n · Σ x xᵀ over the rows a Linear sees (a forward pre-hook)."""

    def __init__(self, cols: int):
        self.H = torch.zeros(cols, cols, dtype=torch.float64)
        self.n = 0

    def __call__(self, mod, args) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
        self.H += 2 * x.T @ x
        self.n += x.shape[0]

    def value(self) -> torch.Tensor:
        return (self.H / max(self.n, 1)).float()


@torch.no_grad()
def gptq_model(model: nn.Module, spec: WeightOnlySpec, batches: list[torch.Tensor], *, damp: float = 0.01,
               act_order: bool = False, progress: bool = True) -> nn.Module:
    """Quantize every block Linear (and the tied head unless `head_bits` is 32 or 16) with GPTQ
    on the calibration `batches` (token id tensors), in place."""
    from gptforge.compress.layerwise import calibrated_walk

    def quantize(name: str, H: torch.Tensor) -> None:
        quantize_layer(model, name, spec, rounder=lambda w, bits: gptq_quantize(
            w, H, bits, spec.group_size, spec.sym, damp=damp_for(name, damp), act_order=act_order, clip=spec.clip))

    return calibrated_walk(model, spec, batches, _Hessian, quantize, desc="gptq", progress=progress)
