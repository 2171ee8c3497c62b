"""`gptforge finetune`: GLUE sequence classification from a pretrained model (docs/finetune.md).

    gptforge finetune --ckpt output/gpt_tiny_cpu --task SST2 --data glue_data/SST-2 --out runs/ft_sst2
    gptforge finetune --ckpt ... --task SST2 --data ... --out runs/ft_sst2 --resume auto   # after Ctrl-C
    gptforge finetune -c finetune_gpt_345M_single_card_glue --ckpt DIR --task MNLI --data glue_data/MNLI

Without -c the recipe is `finetune_gpt_tiny_cpu_glue` (3 epochs, evaluation and a saved epoch_N
each epoch); --task, --data and --epochs set its keys and win over -c and -o.
"""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args
from gptforge.commands.run_args import add_run_args

DEFAULT_RECIPE = "finetune_gpt_tiny_cpu_glue"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Fine-tune a pretrained GPT (ours, an HF GPT-2 directory, a .pdparams, a pruned or QAT model) for "
        "sequence classification on a GLUE task read from local TSV files. Writes classifier directories "
        "(epoch_N) and finetune_results.json under the run directory. Without -c the recipe is "
        f"{DEFAULT_RECIPE}.")
    add_config_args(p, ckpt_help="the pretrained model to fine-tune (overrides Model.pretrained)")
    p.add_argument("--task", metavar="NAME", help=(
        "the GLUE task: CoLA, SST2, MNLI, QNLI, RTE, WNLI, MRPC, QQP, STSB (= -o Data.Train.dataset.name and "
        "Data.Eval.dataset.name)"))
    p.add_argument("--data", metavar="DIR", help=(
        "the task's directory in the GLUE layout (train.tsv, dev.tsv) (= -o Data.Train.dataset.root and "
        "Data.Eval.dataset.root)"))
    p.add_argument("--epochs", metavar="N", type=int, help="training epochs (= -o Engine.num_train_epochs=N)")
    add_run_args(p, "classifier directories epoch_N, finetune_results.json, metrics.jsonl")


def overrides(args: argparse.Namespace) -> list[str]:
    """-o overrides, then the flags (--task, --data, --epochs, --out), which win."""
    out = list(args.override)
    if args.task:
        out += [f"Data.Train.dataset.name={args.task}", f"Data.Eval.dataset.name={args.task}"]
    if args.data:
        out += [f"Data.Train.dataset.root={args.data}", f"Data.Eval.dataset.root={args.data}"]
    if args.epochs is not None:
        out.append(f"Engine.num_train_epochs={args.epochs}")
    if args.run_dir_out:
        out.append(f"Engine.save_load.output_dir={args.run_dir_out}")
    return out


def run(args: argparse.Namespace) -> int:
    from gptforge.commands.common import select_device
    from gptforge.config import load_config
    from gptforge.finetune.run import finetune, summary_line

    # The pretrained model's own training config is not merged in: its shape and structure come
    # with the weights, and the run settings are the fine-tuning recipe's.
    cfg = load_config(args.config or DEFAULT_RECIPE, overrides(args))
    res = finetune(cfg, args.ckpt, device=select_device(cfg.Global.device),
                   progress=False if args.no_progress else None, resume=args.resume, force=args.force)
    print(summary_line(res, cfg.Engine.run_mode))
    return 0
