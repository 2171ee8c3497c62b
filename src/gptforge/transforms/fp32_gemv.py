"""A one-row fp32 GEMV that gives the batch-invariant packed Linear's bits at a GEMV's speed (issue #32).

The decode backend (`generate/backend.py`) runs Linears and the tied head through oneDNN's
small-batch packed weights, whose per-row results never depend on the number of rows. At one
row that kernel is ~40% slower than a GEMV. It sums each output in a fixed order (K in chunks
of 1024, each a sequential FMA chain from zero, chunk sums in order, bias last), which
`csrc/fp32_gemv.cpp` reproduces over weights stored in blocks of 64 outputs. Whether the bits
really match is checked on this CPU, per layer, by `matches_packed` before the backend routes a
layer's one-row products here: a oneDNN build with another order keeps the packed kernel. The
same blocks serve `native_kernels.fp32_rows` (several rows in the same order, each row the
GEMV's bits by construction), which the backend uses for such a layer's several-row products.
"""

from __future__ import annotations

import torch

from gptforge.transforms import huge_pages, native_kernels

BLOCK = 64


def block_weight(w: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 weight -> [ceil(N/64), K, 64]: for each input k, 64 consecutive outputs' weights
    (the last block zero-padded)."""
    w = w.detach()
    n, k = w.shape
    full, tail = divmod(n, BLOCK)
    out = huge_pages.empty((full + bool(tail), k, BLOCK))  # streamed whole at every decode step
    out[:full].copy_(w[: full * BLOCK].view(full, BLOCK, k).transpose(1, 2))  # one copy, no padded staging
    if tail:
        out[full].zero_()
        out[full, :, :tail] = w[full * BLOCK:].t()
    return out


def available() -> bool:
    """Whether the native GEMV can run here: the library built, $GPTFORGE_NATIVE_ISA not `off`,
    and a vector path (the scalar path is exact too, but slower than the packed kernel)."""
    return native_kernels.unavailable() is None and native_kernels.isa() in ("avx2", "avx512")


@torch.no_grad()
def matches_packed(wb: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
                   path: str | None = None, trials: int = 3) -> bool:
    """Whether the GEMV over `wb` equals oneDNN's packed kernel over `packed` bit for bit on
    `trials` random rows (fixed seed; values of mixed magnitudes and signs)."""
    g = torch.Generator().manual_seed(n * 131 + k)
    bias = None if bias is None else bias.detach()  # a bias needing grad sends oneDNN down another path
    for t in range(trials):
        x = torch.randn(1, k, generator=g) * (10.0 ** (t - 1))
        ref = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        if not torch.equal(native_kernels.fp32_gemv(x, wb, bias, n, path), ref):
            return False
    return True
