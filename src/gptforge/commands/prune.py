"""`gptforge prune`: structured pruning (heads, FFN neurons) + fine-tuning; 2:4 sparsity.

    gptforge prune -c prune_gpt_345M_single_card -o Compress.pretrained=DIR
    gptforge prune -c prune_gpt_mini_cpu -o Compress.pretrained=runs/mini/step_600
    gptforge prune --ckpt runs/mini/step_600 --out runs/pruned -o Compress.Prune.ratio=0.25
    gptforge prune -c ... -o Compress.Prune.semi_structured=wanda -o Compress.Prune.ratio=0
    gptforge prune -c ... --resume auto                       # continue an interrupted fine-tune

Loads `Compress.pretrained` (any format `model_io` reads), removes the lowest-scored heads and
FFN neurons (`Compress.Prune`), records the smaller shape in the config, and fine-tunes with
the normal trainer. Every checkpoint it writes is an ordinary model directory for `eval`,
`generate`, `export` and `qat -o Compress.pretrained=...`. See docs/prune.md.
"""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, config_from_args
from gptforge.commands.run_args import add_resume_arg
from gptforge.errors import UsageError

# With --ckpt and no -c the config is the checkpoint's (a pretraining recipe): these give the
# reference's pruning fine-tune recipe (prune_gpt_345M_single_card.yaml) unless -o says otherwise.
# decay_steps is blanked so that the cosine spans this fine-tune (derived: Engine.max_steps).
RECIPE = ("Compress.Prune.enable=True", "Optimizer.weight_decay=0.0", "Optimizer.lr.warmup_rate=0.0",
          "Optimizer.lr.warmup_steps=", "Optimizer.lr.decay_steps=", "Model.hidden_dropout_prob=0.0",
          "Model.attention_probs_dropout_prob=0.0")
DERIVED_RATIOS = ("head_ratio", "ffn_ratio")


def _explicit_prune_keys(args: argparse.Namespace) -> set[str]:
    """Compress.Prune keys this invocation sets itself (in the -c file chain or with -o)."""
    from gptforge.config.loader import load_raw, parse_override

    keys: set[str] = set()
    if args.config:
        prune = ((load_raw(args.config).get("Compress") or {}).get("Prune") or {})
        keys.update(k for k, v in prune.items() if v is not None)
    for text in args.override:
        path, value = parse_override(text)
        if path[:2] == ["Compress", "Prune"] and len(path) == 3 and value is not None:
            keys.add(path[2])
    return keys


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p, ckpt_help=(
        "the trained model to prune (ours, HF GPT-2, .pdparams); same as -o Compress.pretrained=DIR, and its "
        "config and tokenizer are used, so -c is optional (then the reference's fine-tune recipe applies: no "
        "warmup, weight decay 0, dropout 0)"))
    p.add_argument("--out", metavar="DIR", help="run directory for the fine-tune (= -o Engine.save_load.output_dir=DIR)")
    add_resume_arg(p, "; the pruned shape comes from the checkpoint and nothing is pruned again")
    p.add_argument("--save-pruned", metavar="DIR", help=(
        "also write the model right after pruning, before fine-tuning (default with Engine.max_steps=0: "
        "<output_dir>/pruned)"))
    p.add_argument("--hf-out", metavar="DIR", help=(
        "also write the final model as an HF transformers GPT-2 directory (n_inner = pruned FFN width; removed "
        "heads stored as zero heads, since transformers 5 has no pruned_heads)"))
    p.add_argument("--force", action="store_true", help=(
        "overwrite --hf-out / --save-pruned if they exist, and start a new run in a run directory that holds "
        "another run's checkpoints (deleting them, with its metrics.jsonl, train.log, tensorboard events)"))
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gptforge.commands.common import ensure_out_dir
    from gptforge.compress.prune_run import prune_and_finetune

    ckpt = args.ckpt
    if ckpt and not args.config:
        args.override = [*RECIPE, *args.override]
    if args.out:
        args.override = [*args.override, f"Engine.save_load.output_dir={args.out}"]
    cfg = config_from_args(args, require=True)
    if ckpt:
        from gptforge.model_io import resolve_checkpoint_path

        cfg.Compress.pretrained = str(resolve_checkpoint_path(ckpt))
        cfg.Engine.save_load.ckpt_dir = None  # the checkpoint's own run is not resumed
        # A checkpoint's config stores head_ratio / ffn_ratio already derived from its ratio;
        # here they follow this run's ratio unless this run sets them.
        explicit = _explicit_prune_keys(args)
        for key in DERIVED_RATIOS:
            if key not in explicit:
                setattr(cfg.Compress.Prune, key, cfg.Compress.Prune.ratio)
    if args.resume is not None and cfg.Engine.save_load.ckpt_dir:
        raise UsageError("give either --resume or Engine.save_load.ckpt_dir, not both")
    if args.hf_out and cfg.Compress.Quantization.enable:
        raise UsageError("--hf-out writes float GPT-2 weights; a fake-quant run is exported with "
                         "`gptforge quantize` / `gptforge export`, not here")
    for path in (args.hf_out, args.save_pruned):
        if path:
            ensure_out_dir(path, args.force)
    result = prune_and_finetune(cfg, resume=args.resume, save_pruned=args.save_pruned,
                                progress=False if args.no_progress else None, overrides=args.override,
                                force=args.force)
    parts = []
    if result.report is not None:
        r = result.report
        parts.append(f"{r.plan.summary()}; parameters {r.params_before / 1e6:.2f}M -> {r.params_after / 1e6:.2f}M")
    if result.sparsity is not None:
        parts.append(f"2:4 sparse block Linears ({result.sparsity:.1%} zeros)")
    if result.checkpoint_dir is not None:
        parts.append(f"fine-tuned to step {result.train.step}: {result.checkpoint_dir}")
    if result.pruned_dir is not None:
        parts.append(f"pruned model (before fine-tuning): {result.pruned_dir}")
    if args.hf_out:
        from gptforge.export.hf import save_pruned_hf_dir

        save_pruned_hf_dir(result.model, cfg.Model, args.hf_out, result.tokenizer, overwrite=True)
        parts.append(f"HF directory: {Path(args.hf_out)}")
    print("gptforge prune: " + "; ".join(parts))
    return 0
