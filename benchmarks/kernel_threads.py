"""Do gptforge's own CPU kernels use the second thread? Per-call time at 1 and 2 threads.

    PYTHONPATH=src .venv/bin/python benchmarks/kernel_threads.py [--rounds 3] [--calls 200]

The GPT-2 124M batch-1 decode shapes (block Linears 768x2304, 768x768, 768x3072, 3072x768 and the
tied 50304x768 head), one fp32 row: weight-only int8 (per row) and int4 (groups of 64) on the
`native` kernel, int4 on `native-q8a`, and PyTorch's fp32 `F.linear` beside them. Rounds
alternate the thread counts (1, 2, 1, 2, ...); reported: the median per-call microseconds of each
thread count (medians of the rounds' medians) and their ratio, with the load average and the CPU.
`threads_used` is what the library reports for one parallel loop at each count: 1 at two threads
means it was built without torch's OpenMP (every kernel then runs serially; issue #32's finding).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_speed import _median_ms, cpu_name  # noqa: E402 - the shared CPU line and timing loop

SHAPES = ((2304, 768), (768, 768), (3072, 768), (768, 3072), (50304, 768))


def _per_call(fn, calls: int) -> float:
    """Median microseconds per call, after warming the caches."""
    for _ in range(10):
        fn()
    return _median_ms(fn, calls) * 1e3


def _variants(n: int, k: int):
    from gptforge.transforms import lowbit, native_kernels

    w = torch.randn(n, k) * 0.02
    x = torch.randn(1, k)
    out = {"fp32 F.linear": lambda: F.linear(x, w)}
    for bits, group in ((8, 0), (4, 64)):
        q, s, _ = lowbit.quantize_rtn(w, bits, group, True)
        packed = lowbit.pack_int4(q) if bits == 4 else q
        out[f"int{bits} native"] = (lambda p=packed, s=s, b=bits: native_kernels.weight_only_linear(x, p, s, None, None,
                                                                                                      b))
        if bits == 4:
            out["int4 native-q8a"] = lambda p=packed, s=s: native_kernels.weight_only_linear(
                x, p, s, None, None, 4, q8_activations=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    from gptforge.transforms import native_kernels

    why = native_kernels.unavailable()
    if why:
        print(f"gptforge's kernels are unavailable here: {why}")
        return 1
    load0 = os.getloadavg()
    saved = torch.get_num_threads()
    used = {}
    for t in (1, 2):
        torch.set_num_threads(t)
        used[t] = native_kernels.threads_used(64)
    rows = []
    with torch.inference_mode():
        for n, k in SHAPES:
            variants = _variants(n, k)
            got = {(v, t): [] for v in variants for t in (1, 2)}
            for _ in range(args.rounds):
                for t in (1, 2):
                    torch.set_num_threads(t)
                    for name, fn in variants.items():
                        got[(name, t)].append(_per_call(fn, args.calls))
            for name in variants:
                one, two = statistics.median(got[(name, 1)]), statistics.median(got[(name, 2)])
                rows.append((f"{k}x{n}", name, one, two))
    torch.set_num_threads(saved)
    print(f"machine: {cpu_name()}; torch {torch.__version__}; threads_used at 1 / 2 threads: {used[1]} / {used[2]}; "
          f"load average {' '.join(f'{v:.2f}' for v in load0)} -> {' '.join(f'{v:.2f}' for v in os.getloadavg())}\n")
    print("| shape (in x out) | kernel | us per call, 1 thread | 2 threads | 1 / 2 |")
    print("|---|---|---:|---:|---:|")
    for shape, name, one, two in rows:
        print(f"| {shape} | {name} | {one:.0f} | {two:.0f} | {one / two:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
