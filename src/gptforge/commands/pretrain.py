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

from gptforge.commands.common import add_config_args, config_from_args
from gptforge.commands.run_args import add_run_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p, ckpt_help=(
        "continue from this checkpoint; its config and tokenizer are used, so -c is optional. A training "
        "checkpoint (step_N, or a run directory: its newest step) resumes exactly; a plain model directory "
        "(ours, HF GPT-2, .pdparams) starts a new run from its weights"))
    add_run_args(p)


def run(args: argparse.Namespace) -> int:
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.train import pretrain
    from gptforge.train.run_start import plan_start

    cfg = config_from_args(args, require=True)
    start = plan_start(cfg, resume=args.resume, ckpt_path=args.ckpt, force=args.force)
    tokenizer = None
    if start.pretrained is not None:  # a plain model directory: a new run from its weights
        cfg.Compress.pretrained = str(start.pretrained)
    if args.ckpt:
        tok_dir = start.pretrained or start.resume
        tokenizer = load_tokenizer(cfg.Data.tokenizer, tok_dir if tok_dir is not None and tok_dir.is_dir() else None)
    result = pretrain(cfg, tokenizer=tokenizer, start=start, progress=False if args.no_progress else None)
    last = result.checkpoint_dir
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun, rank 0 speaks for the run
    print(f"gptforge pretrain: done at step {result.step}; checkpoint {last}; metrics {result.output_dir}/metrics.jsonl")
    return 0
