"""`gptforge dpo`: Direct Preference Optimization on prompt / chosen / rejected pairs (docs/sft.md).

    gptforge dpo --ckpt output/sft/step_200 --data pref_train.jsonl --eval-data pref_test.jsonl --out output/dpo
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gptforge.commands.sft import add_instruct_arguments

    p.description = (
        "Preference tuning with DPO: raise the likelihood of the chosen answer over the rejected one, relative "
        "to the starting model (the reference; its log-probs are computed once, no second copy of the weights). "
        "Instruct.beta and Instruct.label_smoothing set the loss.")
    add_instruct_arguments(p, "preference pairs: prompt, chosen, rejected")
    p.add_argument("--beta", type=float, help="= Instruct.beta (default 0.1)")


def run(args: argparse.Namespace) -> int:
    from gptforge.commands.sft import instruct_config
    from gptforge.finetune.dpo import dpo

    cfg = instruct_config(args)
    if args.beta is not None:
        cfg.Instruct.beta = args.beta
    res, report = dpo(cfg, args.ckpt, resume=args.resume, progress=False if args.no_progress else None,
                      overwrite=args.force)
    if report:
        (res.output_dir / "dpo_results.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        b, a = report["before"], report["after"]
        print(f"gptforge dpo: held-out preference accuracy {b['accuracy']:.3f} -> {a['accuracy']:.3f} "
              f"(reward accuracy {a['reward_accuracy']:.3f}, margin {a['margin']:.3f}) over {a['pairs']} pairs")
    adapter = f"; adapter {res.metrics['adapter']}" if "adapter" in res.metrics else ""
    print(f"gptforge dpo: done at step {res.step}; model {res.checkpoint_dir}{adapter}")
    return 0
