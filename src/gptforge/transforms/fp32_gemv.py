"""gptforge's batch-invariant fp32 products for decoding (issue #32): a one-row GEMV and its
several-row twin over weights stored in blocks of 64 outputs.

`csrc/fp32_gemv.cpp` sums each output in one fixed order (K in chunks of 1024, each a sequential
FMA chain from zero, chunk sums in order, bias last), the order of oneDNN's small-batch packed
kernel on the AVX2 CPUs measured, so there the bits are that kernel's. `native_kernels.fp32_rows`
gives every row of several the GEMV's bits by construction. The decode backend
(`generate/backend.py`) routes the fp32 Linears and the tied head through them at every row count
wherever they run: a sequence's logits then never depend on what shares its batch, on every CPU,
also where oneDNN sums otherwise or differs between one row and several (AVX-512 Zen 5: its
3072-input products), and one row streams the weights at a GEMV's speed (the packed kernel is up
to ~40% slower there).
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
