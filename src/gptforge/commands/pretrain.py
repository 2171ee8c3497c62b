"""`gptforge pretrain`: Pretrain or continue training a GPT model.

    gptforge pretrain -c pretrain_gpt_tiny_cpu -o Engine.max_steps=200
    gptforge pretrain -c pretrain_gpt_tiny_cpu --resume auto     # newest checkpoint in output_dir
    gptforge pretrain --ckpt output/step_100 -o Engine.max_steps=200          # continue that run
    gptforge pretrain -c configs/pretrain_gpt_tiny_cpu.yaml --force           # start over in output_dir

An output directory belongs to one run: a second process writing into it fails at once (naming
the holder's pid), and a new run into a directory that holds another run's checkpoints is
refused unless `--force` (which deletes them) — continue that run with `--resume auto` instead.

`--ckpt DIR` takes the config and tokenizer from DIR: a training checkpoint (step_N or a run
directory) resumes exactly; a plain model directory (ours, HF GPT-2, .pdparams) starts a new
run from its weights, like `-o Compress.pretrained=DIR`.

Several processes (docs/distributed.md): launch the same command under torchrun; the
`Distributed` section chooses data parallel, FSDP2 sharding and tensor parallel.

    torchrun --nproc_per_node=8 -m gptforge pretrain -c pretrain_gpt_1.3B_single_card
    torchrun --nproc_per_node=2 -m gptforge pretrain -c pretrain_gpt_tiny_cpu -o Distributed.mp_degree=2
"""

from __future__ import annotations

import argparse
import os

from gptforge.commands.common import add_config_args, add_run_dir_arg, config_from_args
from gptforge.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p, ckpt_help=(
        "continue from this checkpoint; its config and tokenizer are used, so -c is optional. A training "
        "checkpoint (step_N, or a run directory: its newest step) resumes exactly; a plain model directory "
        "(ours, HF GPT-2, .pdparams) starts a new run from its weights"))
    p.add_argument("--resume", metavar="auto|DIR", help=(
        "resume a run: 'auto' = the newest complete checkpoint in Engine.save_load.output_dir (starts fresh "
        "when there is none); DIR = that checkpoint (same as -o Engine.save_load.ckpt_dir=DIR)"))
    p.add_argument("--force", action="store_true", help=(
        "start a new run in an output directory that holds another run's checkpoints, deleting them (and its "
        "metrics.jsonl, train.log, tensorboard events); without it such a directory is refused"))
    add_run_dir_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.train import checkpoint as ckpt
    from gptforge.train import pretrain

    cfg = config_from_args(args, require=True)
    resume = args.resume
    if resume is not None and cfg.Engine.save_load.ckpt_dir:
        raise UsageError("give either --resume or Engine.save_load.ckpt_dir, not both")
    tokenizer = None
    if args.ckpt:
        if resume is not None or cfg.Engine.save_load.ckpt_dir:
            raise UsageError("--ckpt already names the checkpoint; drop --resume / Engine.save_load.ckpt_dir")
        p = Path(args.ckpt)
        if ckpt.is_complete(p) or ckpt.latest_checkpoint(p) is not None:
            resume = str(ckpt.resolve_resume_dir(p))
            tok_dir = Path(resume)
        else:
            from gptforge.model_io import resolve_checkpoint_path

            tok_dir = resolve_checkpoint_path(p)
            cfg.Compress.pretrained = str(tok_dir)
        tokenizer = load_tokenizer(cfg.Data.tokenizer, tok_dir if tok_dir.is_dir() else None)
    if args.force and (resume is not None or cfg.Engine.save_load.ckpt_dir):
        raise UsageError("--force starts a new run; it cannot be combined with resuming (--resume, a training "
                         "checkpoint as --ckpt, Engine.save_load.ckpt_dir)")
    result = pretrain(cfg, tokenizer=tokenizer, resume=resume, progress=False if args.no_progress else None,
                      overwrite=args.force)
    last = result.checkpoint_dir
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun, rank 0 speaks for the run
    print(f"gptforge pretrain: done at step {result.step}; checkpoint {last}; metrics {result.output_dir}/metrics.jsonl")
    return 0
