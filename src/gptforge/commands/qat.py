"""`gptforge qat`: INT8 quantization-aware training (spec §8) with the normal trainer; with
`Compress.Quantization.weight_only` 4-bit weight-only QAT (`-c qat_int4_gpt_tiny_cpu`), which
`gptforge quantize --weights int4` turns into an int4 model.

    gptforge qat -c qat_gpt_345M_single_card -o Compress.pretrained=DIR
    gptforge qat -c qat_gpt_tiny_cpu -o Compress.pretrained=runs/tiny/step_400
    gptforge qat -c qat_gpt_tiny_cpu --resume auto      # continue the newest checkpoint
    gptforge qat --ckpt output_qat/step_200 -o Engine.max_steps=400    # continue that run

`--ckpt DIR`: a QAT training checkpoint (step_N, or a run directory) resumes it exactly; any other
model directory (a float training checkpoint, ours, HF GPT-2, .pdparams) is the float model to start
from (= Compress.pretrained). A fresh run refuses an output directory that holds another run's
checkpoints unless `--force` (which deletes them).
"""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, config_from_args
from gptforge.commands.run_args import add_run_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Quantization-aware training: load the float model of Compress.pretrained, insert fake-quant "
                     "modules as Compress.Quantization says, train with the pretrain loop. Checkpoints hold the "
                     "scales; `gptforge eval/generate --ckpt` run the fake-quant model, `gptforge quantize "
                     "--convert` makes a real INT8 model of it. With Compress.Quantization.weight_only (4-bit QAT) only the "
                     "weights are fake-quantized, in groups, and `gptforge quantize --weights int4` makes the int4 "
                     "model.")
    add_config_args(p, ckpt_help=(
        "a QAT training checkpoint to resume (step_N or a run directory), or a float model directory to start "
        "from (same as -o Compress.pretrained=DIR); its config and tokenizer are used, so -c is optional"))
    add_run_args(p)


def run(args: argparse.Namespace) -> int:
    from gptforge.compress.qat import qat
    from gptforge.train.run_start import plan_start

    cfg = config_from_args(args, require=True)
    start = plan_start(cfg, resume=args.resume, ckpt_path=args.ckpt, force=args.force, resumable=_is_qat_run,
                       overrides=args.override)
    if start.pretrained is not None:
        cfg.Compress.pretrained = str(start.pretrained)
    result = qat(cfg, start=start, progress=False if args.no_progress else None)
    print(f"gptforge qat: done at step {result.step}; checkpoint {result.checkpoint_dir}; "
          f"metrics {result.output_dir}/metrics.jsonl")
    return 0


def _is_qat_run(path) -> bool:
    """A training checkpoint (or run directory) of a QAT run, i.e. one to resume."""
    from gptforge.model_io import read_checkpoint_config
    from gptforge.train import checkpoint as ckpt
    from gptforge.train.run_start import is_training_checkpoint

    if not is_training_checkpoint(path):
        return False
    raw = read_checkpoint_config(ckpt.resolve_resume_dir(path))
    return bool(((raw.get("Compress") or {}).get("Quantization") or {}).get("enable"))
