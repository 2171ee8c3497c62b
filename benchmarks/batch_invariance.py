"""Is oneDNN's packed fp32 Linear batch-invariant on this CPU? The decode backend's promise that a
sequence's logits do not depend on what shares its batch (`gptforge serve` = `generate` bit for
bit) rests on it where gptforge's native kernels do not run (`GPTFORGE_NATIVE_ISA=off`, no
compiler); where they run, every fp32 product takes them, invariant by construction
(tests/test_fp32_gemv.py). For GPT-2 124M's shapes, rows computed in batches of 1, 2, 3, 5, 8, 17, 64 and
300 are compared with the same rows computed in pairs; prints the row counts that differ.

    python benchmarks/batch_invariance.py [--threads 1 2 4]
"""
from __future__ import annotations

import argparse

import torch

from gptforge.generate.backend import packed_rows_invariant

SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072), (128, 768), (50257, 768)]
ROWS = (1, 2, 3, 5, 8, 17, 64, 300)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for n, k in SHAPES:
        for t in args.threads:
            torch.set_num_threads(t)
            bad = packed_rows_invariant(n, k, ROWS)
            print(f"{n}x{k}, {t} thread(s): " + (", ".join(f"{m} rows ({d:.1e})" for m, d in bad.items()) or "invariant"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
