"""fp32 products of several rows: gptforge's `fp32_rows` (the packed kernel's summation order,
rows sharing each weight load; `transforms/csrc/fp32_gemv.cpp`) vs oneDNN's packed small-batch
Linear (what the decode backend ran before), GPT-2 124M shapes, at row counts from 1 to 1024.

    .venv/bin/python benchmarks/fp32_rows.py [--threads 2] [--rows 1 2 4 8 16 43 81 128]

Per shape and row count: GFLOP/s of each (median of 5 interleaved rounds), their ratio, and
whether the outputs are bit-identical (`!=oneDNN` where not: a CPU whose oneDNN sums in another
order or is not batch-invariant) and equal to the one-row GEMV on each row (`!=GEMV`: a bug).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_speed import cpu_name  # noqa: E402 - the shared CPU line

SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072), (50304, 768)]  # (out, in)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 43, 81, 128])
    args = ap.parse_args()
    from gptforge.transforms import fp32_gemv, native_kernels

    why = native_kernels.unavailable()
    if why:
        print(f"gptforge's kernels are unavailable here ({why})")
        return 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"machine: {cpu_name()}, {args.threads} threads, native path {native_kernels.isa()}; torch "
          f"{torch.__version__}; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}\n")
    print("| shape (out x in) | rows | fp32_rows GFLOP/s | oneDNN packed GFLOP/s | ratio | bits |")
    print("|---|---:|---:|---:|---:|---|")
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        b = torch.randn(n) * 0.1 if n < 50000 else None  # the head has no bias
        p = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        wb = fp32_gemv.block_weight(w)
        for m in args.rows:
            x = torch.randn(m, k)
            ref = torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")
            y = native_kernels.fp32_rows(x, wb, b, n)
            alone = torch.cat([native_kernels.fp32_gemv(x[i:i + 1], wb, b, n) for i in range(m)])
            bits = ("same" if torch.equal(y, ref) else "!=oneDNN") + ("" if torch.equal(y, alone) else " !=GEMV")
            reps = max(2, int(2e8 / (2 * m * n * k)))
            ours, theirs = [], []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(reps):
                    native_kernels.fp32_rows(x, wb, b, n)
                ours.append((time.perf_counter() - t) / reps)
                t = time.perf_counter()
                for _ in range(reps):
                    torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")
                theirs.append((time.perf_counter() - t) / reps)
            a, o = statistics.median(ours), statistics.median(theirs)
            flop = 2 * m * n * k
            print(f"| {n}x{k} | {m} | {flop / a / 1e9:.0f} | {flop / o / 1e9:.0f} | {o / a:.2f}x | {bits} |", flush=True)
    print(f"\n(load average now {' '.join(f'{v:.2f}' for v in os.getloadavg())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
