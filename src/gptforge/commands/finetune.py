"""`gptforge finetune`: GLUE sequence classification from a pretrained model (docs/finetune.md)."""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, add_run_dir_arg, run_dir_overrides


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Fine-tune a pretrained GPT (ours, an HF GPT-2 directory, a .pdparams, a pruned or QAT model) for "
        "sequence classification on a GLUE task read from local TSV files (Data.Train.dataset: name, root, "
        "split, max_length). Writes classifier directories (epoch_N) and finetune_results.json under "
        "Engine.save_load.output_dir.")
    add_config_args(p, ckpt_help="the pretrained model to fine-tune (overrides Model.pretrained)")
    add_run_dir_arg(p, "classifier directories epoch_N, finetune_results.json, metrics.jsonl")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from gptforge.commands.common import select_device
    from gptforge.config import load_config
    from gptforge.errors import UsageError
    from gptforge.finetune.run import finetune

    if not args.config and not args.override:
        raise UsageError("give a fine-tuning config with -c FILE (see docs/finetune.md)")
    # The pretrained model's own training config is not merged in: its shape and structure come
    # with the weights, and the run settings are the fine-tuning recipe's.
    cfg = load_config(args.config, run_dir_overrides(args))
    res = finetune(cfg, args.ckpt, device=select_device(cfg.Global.device),
                   progress=False if args.no_progress else None)
    if res.best is not None:
        splits = [k for k in res.best if isinstance(res.best[k], dict)]
        shown = ", ".join(f"{s} {res.best[s]['main']:.4f}" for s in splits)
        print(f"gptforge finetune: {res.task}, {res.steps} steps; best ({'epoch' if cfg.Engine.run_mode == 'epoch' else 'step'} "
              f"{res.best['epoch'] if cfg.Engine.run_mode == 'epoch' else res.best['step']}): {shown} -> {res.checkpoint_dir}")
    else:
        print(f"gptforge finetune: {res.task}, {res.steps} steps -> {res.checkpoint_dir}")
    return 0
