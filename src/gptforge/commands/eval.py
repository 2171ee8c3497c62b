"""`gptforge eval`: LAMBADA cloze accuracy / WikiText perplexity / lm-eval tasks."""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_adapter_arg, add_config_args, add_overwrite_arg
from gptforge.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Evaluate a model on your own data files (nothing is downloaded). With Offline_Eval.cloze_eval=True: "
        "LAMBADA accuracy on a jsonl of {\"text\": ...}; otherwise WikiText perplexity on a text file. "
        "With --harness: lm-eval tasks from local task YAMLs."
    )
    add_config_args(p)
    add_adapter_arg(p)
    p.add_argument("--out", "--output", dest="output", metavar="FILE",
                   help="results JSON (default: Offline_Eval.output, else ./eval_results_<task>.json in the working "
                        "directory; never inside the checkpoint unless given here)")
    add_overwrite_arg(p, "the results JSON")
    p.add_argument("--emulate-reference-aggregation", action="store_true",
                   help="also report the number the reference's engine would log (batch 0 counted "
                        "logging_freq times, tail dropped); clearly labelled, never the main result")
    p.add_argument("--restrict-vocab", action="store_true",
                   help="argmax/softmax over the tokenizer's ids only (default: every column of the "
                        "model's padded vocabulary, as the reference and HF do)")
    p.add_argument("--lambada-split", choices=("reference", "lm_eval"), metavar="{reference,lm_eval}",
                   help="LAMBADA context/target rule (= Offline_Eval.lambada_split): reference (default: the last "
                        "whitespace-separated word, the reference's rule) or lm_eval (lambada_openai's split on ' ', "
                        "example by example)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (lm-eval's and datasets' too)")
    p.add_argument("--glue-file", metavar="FILE",
                   help="a fine-tuned classifier (gptforge finetune): score this GLUE TSV (default: "
                        "Data.Eval.dataset.root + split) with the task metric")
    h = p.add_argument_group("lm-eval (optional extra: pip install 'gptforge[eval]')")
    h.add_argument("--harness", metavar="TASKS", help="comma-separated lm-eval task names to run instead")
    h.add_argument("--include-path", metavar="DIR", help="directory of lm-eval task YAMLs (local data files)")
    h.add_argument("--builtin-tasks", action="store_true",
                   help="also index lm-eval's own tasks (~14 s; they need their datasets available offline)")
    h.add_argument("--limit", type=float, metavar="N", help="lm-eval: at most N documents per task (<1: a fraction)")
    h.add_argument("--num-fewshot", type=int, metavar="K", help="lm-eval: few-shot examples per prompt")


def run(args: argparse.Namespace) -> int:
    from gptforge.commands.common import (
        config_from_args,
        ensure_out_file,
        load_model_and_tokenizer,
        select_device,
    )

    if (args.include_path or args.builtin_tasks or args.limit is not None or args.num_fewshot is not None) \
            and not args.harness:
        raise UsageError("--include-path/--builtin-tasks/--limit/--num-fewshot only apply with --harness TASKS")
    if args.lambada_split:
        args.override = [*args.override, f"Offline_Eval.lambada_split={args.lambada_split}"]
    cfg = config_from_args(args, require=True)
    if not args.ckpt:
        raise UsageError("give the model to evaluate with --ckpt DIR (ours, an HF GPT-2 directory or a .pdparams)")
    from gptforge.evaluate.runner import results_path, task_kind
    from gptforge.finetune.classifier import is_classifier_dir
    from gptforge.model_io import resolve_checkpoint_path

    glue = bool(is_classifier_dir(resolve_checkpoint_path(args.ckpt)) or args.glue_file)
    kind = "glue" if glue else "harness" if args.harness else task_kind(cfg)
    ensure_out_file(results_path(cfg, kind, args.output), args.force)  # before a model or data file is read
    device = select_device(cfg.Global.device)
    if glue:
        return _run_glue(args, cfg, device)
    model, cfg, tok = load_model_and_tokenizer(args, cfg, device=device)
    if args.harness:
        return _run_harness(args, cfg, model, tok)
    from gptforge.evaluate import run_eval

    run_eval(cfg, model, tok, output=args.output, ckpt=args.ckpt,
             emulate_reference_aggregation=args.emulate_reference_aggregation,
             restrict_vocab=args.restrict_vocab, progress=not args.no_progress)
    return 0


def _run_harness(args, cfg, model, tok) -> int:
    from gptforge.evaluate.common import amp_dtype_for, model_context, model_device
    from gptforge.evaluate.harness import run_harness
    from gptforge.evaluate.runner import results_path

    if args.emulate_reference_aggregation:
        raise UsageError("--emulate-reference-aggregation applies to LAMBADA/WikiText, not --harness")
    limit = args.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    oe = cfg.Offline_Eval
    run_harness(model, tok, args.harness, include_path=args.include_path, batch_size=oe.batch_size,
                limit=limit, num_fewshot=args.num_fewshot, builtin_tasks=args.builtin_tasks,
                output=results_path(cfg, "harness", args.output),
                max_length=min(oe.max_seq_len or model_context(model), model_context(model)),
                vocab_size=tok.vocab_size if args.restrict_vocab else None,
                amp_dtype=amp_dtype_for(cfg, model_device(model)), progress=not args.no_progress)
    return 0


def _run_glue(args, cfg, device) -> int:
    from gptforge.evaluate.glue import run_glue_eval
    from gptforge.finetune.classifier import load_classifier

    if args.harness or args.emulate_reference_aggregation or args.restrict_vocab:
        raise UsageError("--harness/--emulate-reference-aggregation/--restrict-vocab apply to language models, "
                         "not to a fine-tuned classifier")
    clf, cfg, tok, task = load_classifier(args.ckpt, cfg, device=device)
    run_glue_eval(cfg, clf, tok, task, file=args.glue_file, output=args.output, ckpt=args.ckpt)
    return 0
