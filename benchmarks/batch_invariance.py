"""Is oneDNN's packed fp32 Linear batch-invariant on this CPU? The decode backend's promise that a
sequence's logits do not depend on what shares its batch (`gptforge serve` = `generate` bit for
bit) rests on it. For GPT-2 124M's shapes, rows computed in batches of 1, 2, 3, 5, 8, 17, 64 and
300 are compared with the same rows computed in pairs; prints the row counts that differ.

    python benchmarks/batch_invariance.py [--threads 1 2 4]
"""
from __future__ import annotations

import argparse

import torch

SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072), (128, 768), (50257, 768)]
ROWS = (1, 2, 3, 5, 8, 17, 64, 300)


def _run(x, p, b):
    return torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")


def differing_rows(n: int, k: int, threads: int, layout_rows: int = 8) -> dict[int, float]:
    """{row count: max |difference|} for the batch sizes whose first 8 rows differ from pairs."""
    torch.manual_seed(0)
    w, b = torch.randn(n, k) * 0.05, (torch.randn(n) if n < 50000 else None)
    p = torch.ops.mkldnn._reorder_linear_weight(w, layout_rows)
    xs = torch.randn(300, k)
    torch.set_num_threads(threads)
    ref = torch.stack([_run(xs[i:i + 1].repeat(2, 1), p, b)[0] for i in range(8)])
    bad = {}
    for m in ROWS:
        ys = _run(xs[:m], p, b)[:8] if m >= 8 else torch.cat([_run(xs[i:i + m], p, b)[:1] for i in range(8)])
        if not torch.equal(ys, ref):
            bad[m] = float((ys - ref).abs().max())
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for n, k in SHAPES:
        for t in args.threads:
            bad = differing_rows(n, k, t)
            print(f"{n}x{k}, {t} thread(s): " + (", ".join(f"{m} rows ({d:.1e})" for m, d in bad.items()) or "invariant"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
