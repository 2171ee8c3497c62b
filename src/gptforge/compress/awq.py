"""AWQ, activation-aware weight quantization (Lin et al. 2023, arXiv:2306.00978), as a search of
one scale per input channel.

Weights that meet large activations matter most. AWQ scales input channel j of a Linear's
weight by s_j = mean|x_j|^α before rounding and divides the input by s_j at run time, so the
salient channels get finer steps; α in [0, 1] is searched on a grid per layer to minimise the
layer's output error ||X Wᵀ - (X / s) Q(W · s)ᵀ||² on calibration inputs X (α = 0 is plain
round-to-nearest, so the search never does worse than RTN on the calibration data). The paper
folds s into the previous operator; here every layer keeps s as `act_scale` (GELU sits before
`linear2`, which no LayerNorm or Linear can absorb), an elementwise division per call. The
tied embedding / head is rounded to nearest (scaling its columns would scale the lookup too).
"""

from __future__ import annotations

import torch
from torch import nn

from gptforge.transforms import lowbit
from gptforge.transforms.weight_only import WeightOnlySpec, quantize_layer

MAX_ROWS = 4096  # calibration rows kept per layer for the search (evenly spaced over the inputs)


class _Inputs:
    """A forward pre-hook keeping a Linear's input rows."""

    def __init__(self, cols: int):
        self.rows: list[torch.Tensor] = []

    def __call__(self, mod, args) -> None:
        self.rows.append(args[0].detach().reshape(-1, args[0].shape[-1]).float())

    def value(self) -> torch.Tensor:
        x = torch.cat(self.rows)
        return x[torch.linspace(0, len(x) - 1, min(len(x), MAX_ROWS)).long()]


def _rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    return lowbit.dequantize(*lowbit.quantize_rtn(w, bits, group_size, sym), group_size)


@torch.no_grad()
def awq_scale(W: torch.Tensor, X: torch.Tensor, bits: int, group_size: int = 0, sym: bool = True,
              grid: int = 20) -> tuple[torch.Tensor, float, float]:
    """(s [in], the layer's output MSE with it, the MSE of plain RTN) for weight W [out, in] and
    calibration inputs X [rows, in]: s = mean|x|^α (normalised to a geometric mean of 1 over its
    extremes), α the best of `grid` + 1 evenly spaced values in [0, 1]."""
    ref = X @ W.T
    act = X.abs().mean(0).clamp_min(1e-8)
    best, best_s, rtn = float("inf"), torch.ones_like(act), float("nan")
    for k in range(grid + 1):
        s = act.pow(k / grid)
        s = (s / (s.max() * s.min()).sqrt()).clamp_min(1e-4)
        err = float(((X / s) @ _rtn(W * s, bits, group_size, sym).T - ref).pow(2).mean())
        if k == 0:
            rtn = err
        if err < best:
            best, best_s = err, s
    return best_s, best, rtn


@torch.no_grad()
def awq_model(model: nn.Module, spec: WeightOnlySpec, batches: list[torch.Tensor], *, grid: int = 20,
              progress: bool = True) -> nn.Module:
    """Quantize every block Linear with AWQ's searched input scales on the calibration `batches`
    (the head rounded to nearest), in place."""
    from gptforge.compress.layerwise import calibrated_walk

    def quantize(name: str, X: torch.Tensor) -> None:
        lin = model.get_submodule(name)
        s, _, _ = awq_scale(lin.weight.detach().float(), X, spec.bits_for(name), spec.group_size, spec.sym, grid)
        quantize_layer(model, name, spec, act_scale=s)

    return calibrated_walk(model, spec, batches, _Inputs, quantize, desc="awq", head=False, progress=progress)
