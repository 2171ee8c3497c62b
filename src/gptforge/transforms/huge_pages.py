"""Buffers on transparent huge pages for the weights the decode kernels stream (issue #32).

A batch-1 decode step reads every weight once, from memory: with 4 KiB pages that is a TLB miss
every 4 KiB of each stream. Linux backs a region with 2 MiB pages when it is advised so
(`madvise(MADV_HUGEPAGE)`, honoured where /sys/kernel/mm/transparent_hugepage/enabled is `always`
or `madvise`, the usual defaults) and the advice comes before the pages are first touched. The
fp32 GEMV's weight blocks are made here, and the decode backend moves the weight-only layers'
weights here (`rehome_`) when it opens: on a 2-core Zen 3 the 124M decode went from 0.98x to
1.03x llama.cpp f32 in fp32 and from 0.88x to 0.98x q4_0 in int4 (medians of alternated runs;
benchmarks/results/2026-11-27-rows-prefetch.md). Only a hint: where it is not available (another
OS, a kernel without THP, `GPTFORGE_HUGE_PAGES=off`) the buffer is an ordinary one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys

import torch
from torch import nn

from gptforge.transforms.cpu_kernels import requested_choice

HUGE = 2 << 20  # bytes in one huge page (x86-64, arm64 with 4 KiB base pages)
MADV_HUGEPAGE = 14
ENV = "GPTFORGE_HUGE_PAGES"


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise, or None where huge pages are not asked for here (read once per process;
    UsageError naming the variable for a value other than auto / on / off)."""
    if requested_choice(None, ENV, ("auto", "on", "off"), ENV) == "off" or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):  # pragma: no cover - no libc
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized CPU tensor whose whole 2 MiB pages are advised as huge pages (its start
    aligned to one) when it spans at least one; otherwise, or where that cannot be advised, a plain
    `torch.empty`. Write it only after this returns: the advice covers pages not yet touched."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if madvise is None or nbytes < HUGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)  # the slack before the aligned start is never touched
    off = -raw.data_ptr() % HUGE
    if madvise(raw.data_ptr() + off, nbytes // HUGE * HUGE, MADV_HUGEPAGE) != 0:
        return torch.empty(shape, dtype=dtype)  # EINVAL on a kernel without THP: nothing to gain
    return raw[off:off + nbytes].view(dtype).view(shape)


def rehome_(module: nn.Module, name: str) -> None:
    """Put `module`'s CPU buffer `name` on huge pages (a copy: the same values, shape and dtype) when
    it spans at least one and is not 2 MiB-aligned already; a buffer elsewhere, or where `empty`
    cannot advise, stays as it is."""
    t = module._buffers.get(name)
    if t is None or t.device.type != "cpu" or t.numel() * t.element_size() < HUGE or t.data_ptr() % HUGE == 0:
        return
    h = empty(tuple(t.shape), t.dtype)
    if h.data_ptr() % HUGE == 0:
        setattr(module, name, h.copy_(t))
