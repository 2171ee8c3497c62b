"""`gptforge sft`: instruction-tune a pretrained model on chat / instruction data (docs/sft.md).

    gptforge sft --ckpt output/gpt_tiny_cpu/step_300 --data train.jsonl --out output/sft
    gptforge sft --ckpt BASE --data train.jsonl --eval-data dev.jsonl --chat-template chatml.jinja
    gptforge sft --ckpt BASE --data train.jsonl --out output/sft --resume auto   # continue after a stop
"""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, add_run_dir_arg, run_dir_overrides


def add_instruct_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """The flags `sft` and `dpo` share; each is a shorthand for an Instruct key."""
    add_config_args(p, ckpt_help="the model to tune (ours, an HF GPT-2 directory, a .pdparams); = Model.pretrained")
    p.add_argument("--data", nargs="+", metavar="FILE", help=f"{what} (JSON / JSONL); = Instruct.train_data")
    p.add_argument("--eval-data", nargs="+", metavar="FILE", help="validation files; = Instruct.eval_data")
    p.add_argument("--method", choices=("full", "lora"), help="= Instruct.method (default full)")
    p.add_argument("--chat-template", metavar="FILE", help="a .jinja file or a tokenizer_config.json; "
                   "= Instruct.chat_template (default: the model's own, else gptforge's)")
    p.add_argument("--resume", metavar="auto|DIR", help="resume a stopped run: 'auto' = the newest checkpoint "
                   "in the output directory")
    p.add_argument("--force", action="store_true", help="start over in an output directory that holds another "
                   "run's checkpoints (deletes them)")
    add_run_dir_arg(p, "checkpoints step_N (model directories with the chat template), metrics.jsonl, train.log")


def instruct_config(args: argparse.Namespace):
    """The config from -c/-o with the flags applied (they win)."""
    from gptforge.config import load_config

    extra = []
    if args.data:
        extra.append(f"Instruct.train_data={','.join(args.data)}")
    if args.eval_data:
        extra.append(f"Instruct.eval_data={','.join(args.eval_data)}")
    if args.method:
        extra.append(f"Instruct.method={args.method}")
    if args.chat_template:
        extra.append(f"Instruct.chat_template={args.chat_template}")
    # As `finetune`: the base model's training config is not merged in; its shape comes with the weights.
    return load_config(args.config, [*run_dir_overrides(args), *extra])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Supervised instruction tuning: train a pretrained GPT on conversations (alpaca, messages, sharegpt) "
        "rendered with a chat template, or on prompt/completion text; the loss covers the assistant turns "
        "(or completions) and EOS. Examples are packed into rows without attending across examples.")
    add_instruct_arguments(p, "instruction data")
    p.add_argument("--no-packing", action="store_true", help="one example per row (= Instruct.packing=False)")


def run(args: argparse.Namespace) -> int:
    from gptforge.finetune.sft import sft

    cfg = instruct_config(args)
    if args.no_packing:
        cfg.Instruct.packing = False
    res = sft(cfg, args.ckpt, resume=args.resume, progress=False if args.no_progress else None,
              overwrite=args.force)
    ev = f"; validation loss {res.eval_losses[-1][1]:.4f}" if res.eval_losses else ""
    adapter = f"; adapter {res.metrics['adapter']}" if "adapter" in res.metrics else ""
    print(f"gptforge sft: done at step {res.step}{ev}; model {res.checkpoint_dir}{adapter}")
    return 0
