"""`gptforge ptq`: post-training INT8 quantization, the baseline QAT must beat.

    gptforge ptq -c qat_gpt_tiny_cpu -o Compress.pretrained=runs/tiny/step_400 --out runs/ptq
    gptforge ptq --ckpt runs/tiny/step_400 --out runs/ptq -o Compress.Quantization.calib_algo=abs_max

Inserts the fake-quant modules of Compress.Quantization into the float model and calibrates the
activation scales on Compress.Quantization.calib_batches batches of the run's Train data (no
training). The output directory loads, evaluates and converts like a QAT checkpoint.
"""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, add_overwrite_arg, config_from_args
from gptforge.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Post-training quantization: fake-quant modules + activation scales calibrated on a few "
                     "Train batches, no training.")
    add_config_args(p, ckpt_help=("the float model to quantize (= Compress.pretrained); its config and tokenizer "
                                  "are used, so -c is optional"))
    p.add_argument("--out", required=True, metavar="DIR", help="output model directory")
    p.add_argument("--calib-batches", type=int, metavar="N", help="= -o Compress.Quantization.calib_batches=N")
    add_overwrite_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from gptforge.commands.common import ensure_out_dir
    from gptforge.compress.ptq import ptq

    cfg = config_from_args(args, require=True)
    if args.calib_batches is not None:
        if args.calib_batches < 1:
            raise UsageError(f"--calib-batches: must be >= 1, got {args.calib_batches}")
        cfg.Compress.Quantization.calib_batches = args.calib_batches
    from gptforge.run_lock import lock_output

    with lock_output(args.out, "ptq"):  # a second writer of --out fails at once, naming this one
        ensure_out_dir(args.out, args.force)  # an existing empty directory is fine too
        res = ptq(cfg, args.out, source=args.ckpt or None, overwrite=True, progress=not args.no_progress)
    print(f"gptforge ptq: {len(res.scales)} layers calibrated from {res.source} -> {res.out_dir}")
    return 0
