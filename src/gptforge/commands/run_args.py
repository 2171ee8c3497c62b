"""`--resume` and `--force`: the flags of every verb that trains into a run directory (pretrain, qat,
prune, finetune), read by `train.run_start.plan_start`."""

from __future__ import annotations

import argparse


def add_resume_arg(p: argparse.ArgumentParser, note: str = "") -> None:
    """`--resume auto|DIR`."""
    p.add_argument("--resume", metavar="auto|DIR", help=(
        "continue a run: 'auto' = the newest complete checkpoint in the run directory (starts fresh when there "
        f"is none); DIR = that checkpoint or run directory (same as -o Engine.save_load.ckpt_dir=DIR){note}"))


def add_force_arg(p: argparse.ArgumentParser, also: str = "") -> None:
    """`--force`: a new run into a directory holding another run's checkpoints."""
    p.add_argument("--force", action="store_true", help=(
        "start a new run in a run directory that holds another run's checkpoints, deleting them (and its "
        f"metrics.jsonl, train.log, tensorboard events{also}); without it such a directory is refused"))


def add_run_args(p: argparse.ArgumentParser, out_what: str | None = None) -> None:
    """--resume, --force, --out and --no-progress: the block of every verb that trains into a run dir."""
    from gptforge.commands.common import add_run_dir_arg

    add_resume_arg(p)
    add_force_arg(p)
    if out_what:
        add_run_dir_arg(p, out_what)
    else:
        add_run_dir_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
