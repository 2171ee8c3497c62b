"""`gptforge qat`: INT8 quantization-aware training (spec §8) with the normal trainer.

    gptforge qat -c qat_gpt_345M_single_card -o Compress.pretrained=DIR
    gptforge qat -c qat_gpt_tiny_cpu -o Compress.pretrained=runs/tiny/step_400
    gptforge qat -c qat_gpt_tiny_cpu --resume auto      # continue the newest checkpoint
    gptforge qat --ckpt output_qat/step_200 -o Engine.max_steps=400    # continue that run

`--ckpt DIR`: a QAT training checkpoint (step_N, or a run directory) resumes it exactly; any other
model directory (a float training checkpoint, ours, HF GPT-2, .pdparams) is the float model to start
from (= Compress.pretrained). A fresh run refuses an output directory that already holds checkpoints.
"""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, add_run_dir_arg, config_from_args
from gptforge.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Quantization-aware training: load the float model of Compress.pretrained, insert fake-quant "
                     "modules as Compress.Quantization says, train with the pretrain loop. Checkpoints hold the "
                     "scales; `gptforge eval/generate --ckpt` run the fake-quant model, `gptforge quantize "
                     "--convert` makes a real INT8 model of it.")
    add_config_args(p, ckpt_help=(
        "a QAT training checkpoint to resume (step_N or a run directory), or a float model directory to start "
        "from (same as -o Compress.pretrained=DIR); its config and tokenizer are used, so -c is optional"))
    p.add_argument("--resume", metavar="auto|DIR", help=(
        "resume: 'auto' = the newest complete checkpoint in Engine.save_load.output_dir (starts fresh when there "
        "is none); DIR = that checkpoint"))
    add_run_dir_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gptforge.compress.qat import qat
    from gptforge.train import checkpoint as ckpt

    cfg = config_from_args(args, require=True)
    resume = args.resume
    if resume is not None and cfg.Engine.save_load.ckpt_dir:
        raise UsageError("give either --resume or Engine.save_load.ckpt_dir, not both")
    if args.ckpt:
        if resume is not None or cfg.Engine.save_load.ckpt_dir:
            raise UsageError("--ckpt already names the checkpoint; drop --resume / Engine.save_load.ckpt_dir")
        p = Path(args.ckpt)
        if _is_qat_run(p):
            resume = str(ckpt.resolve_resume_dir(p))
        else:
            from gptforge.model_io import resolve_checkpoint_path

            cfg.Compress.pretrained = str(resolve_checkpoint_path(p))
    out = Path(cfg.Engine.save_load.output_dir).expanduser()
    if resume is None and not cfg.Engine.save_load.ckpt_dir and ckpt.latest_checkpoint(out) is not None:
        raise UsageError(f"Engine.save_load.output_dir {out} already holds step checkpoints; choose another directory "
                         "(--out DIR) or continue that run with --resume auto")
    result = qat(cfg, resume=resume, progress=False if args.no_progress else None, overrides=args.override)
    print(f"gptforge qat: done at step {result.step}; checkpoint {result.checkpoint_dir}; "
          f"metrics {result.output_dir}/metrics.jsonl")
    return 0


def _is_qat_run(path) -> bool:
    """A training checkpoint (or run directory) of a QAT run, i.e. one to resume."""
    from gptforge.train import checkpoint as ckpt

    if not (ckpt.is_complete(path) or ckpt.latest_checkpoint(path) is not None):
        return False
    from gptforge.model_io import read_checkpoint_config

    raw = read_checkpoint_config(ckpt.resolve_resume_dir(path))
    return bool(((raw.get("Compress") or {}).get("Quantization") or {}).get("enable"))
