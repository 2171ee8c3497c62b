"""`gptforge demo`: the whole life cycle on the built-in corpus, with a report.

    gptforge demo                       # = make demo: about 12 minutes on 2 CPU cores
    gptforge demo --quick --out runs/q  # the same stages on a tiny model, under 3 minutes
    gptforge demo --minutes 30          # more training steps in a larger budget

Stages: learn a tokenizer and tokenize the built-in corpus → cut held-out text and a cloze set
from documents never trained on → pretrain → generate → PTQ → QAT → sensitivity analysis → QAT
with the most sensitive layers float → prune + fine-tune → pruned + QAT → real INT8 models →
evaluate every model → export (HF, ONNX INT8) and generate with onnxruntime → report
(<out>/report.md, <out>/report.html). Each stage runs the real `gptforge` verb; the report
lists every command. An interrupted demo continues where it stopped when run again.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="demo directory (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a tiny model and short runs (under 3 minutes): a smoke test")
    p.add_argument("--minutes", type=float, metavar="M", help=(
        "time budget for the whole demo; training steps are fitted to it from a measured step "
        "(default 12, or 2.5 with --quick)"))
    p.add_argument("--weight-bits", type=int, default=8, metavar="B", help=(
        "QAT/PTQ weight bits (default 8, the reference's INT8; 4 shows larger quantization gaps)"))
    p.add_argument("--prune-ratio", type=float, default=0.25, metavar="R",
                   help="share of heads and FFN neurons removed per layer (default %(default)s)")
    p.add_argument("--top-k", type=int, metavar="K", help=(
        "layers left float after the sensitivity analysis (default: the analysis' suggestion, at most a "
        "quarter of the layers)"))
    p.add_argument("--device", default="auto", help="auto (GPU when present) | cpu | cuda (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="start over in --out, deleting an earlier demo there")
    p.add_argument("--quiet", action="store_true", help="print only errors")


def run(args: argparse.Namespace) -> int:
    from gptforge.demo import FULL, QUICK, Settings, run_demo
    from gptforge.errors import UsageError

    minutes = args.minutes if args.minutes is not None else (2.5 if args.quick else 12.0)
    if minutes <= 0:
        raise UsageError(f"--minutes: must be > 0, got {minutes:g}")
    if args.weight_bits not in range(2, 9):
        raise UsageError(f"--weight-bits: must be 2..8, got {args.weight_bits}")
    if not 0.0 < args.prune_ratio < 1.0:
        raise UsageError(f"--prune-ratio: must be between 0 and 1 (exclusive), got {args.prune_ratio:g}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k: must be >= 1, got {args.top_k}")
    s = Settings(out=args.out, quick=args.quick, minutes=minutes, weight_bits=args.weight_bits,
                 prune_ratio=args.prune_ratio, top_k=args.top_k, device=args.device,
                 shape=QUICK if args.quick else FULL)
    res = run_demo(s, args.run_verb, force=args.force, echo=not args.quiet)
    if not args.quiet:
        print(f"gptforge demo: report {res['report']['md']} and {res['report']['html']}")
    return 0
