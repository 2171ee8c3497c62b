"""`gptforge quantize`: turn a QAT/PTQ model into a real INT8 model, or show its quantization.

    gptforge quantize --ckpt runs/qat/step_400 --out runs/int8 --convert
    gptforge quantize --ckpt runs/int8                      # per-layer table of a quantized model
    gptforge generate --ckpt runs/int8 ...; gptforge eval --ckpt runs/int8 ...

`--convert` writes int8 weights + fp32 steps (safetensors) and checks the INT8 model against the
fake-quant one on a batch (SQNR of the logits, greedy-argmax agreement: int8_report.json).
"""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args
from gptforge.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Convert a fake-quant (QAT or PTQ) model into a real INT8 model that runs fbgemm's int8 "
                     "kernels on x86 CPUs, or print a quantized model's per-layer quantization.")
    add_config_args(p, ckpt_help="the QAT/PTQ model directory (a training step_N works)")
    p.add_argument("--convert", action="store_true", help="write the real INT8 model to --out")
    p.add_argument("--out", metavar="DIR", help="output directory for --convert")
    p.add_argument("--embedding", choices=("auto", "int8", "float"), default="auto",
                   help="the tied word embedding / LM head: auto (default) = int8 per row when the model was trained "
                        "with it quantized (Compress.Quantization.quantize_embedding), else float; int8 / float force it")
    p.add_argument("--no-check", action="store_true", help="skip the logits check against the fake-quant model")
    p.add_argument("--force", action="store_true", help="overwrite --out")


def run(args: argparse.Namespace) -> int:
    from gptforge.commands.common import config_from_args, ensure_out_dir, require_ckpt

    require_ckpt(args)
    cfg = config_from_args(args)
    if not args.convert:
        if args.out or args.embedding != "auto" or args.no_check:
            raise UsageError("--out/--embedding/--no-check apply with --convert")
        return _show(args, cfg)
    if not args.out:
        raise UsageError("give the output directory with --out DIR")
    from gptforge.compress.int8_convert import convert_checkpoint
    from gptforge.run_lock import lock_output

    with lock_output(args.out, "quantize"):  # a second writer of --out fails at once, naming this one
        ensure_out_dir(args.out, args.force)
        emb = {"auto": None, "int8": True, "float": False}[args.embedding]
        from gptforge.progress import task

        with task(f"quantize: INT8 conversion{'' if args.no_check else ' and logits check'}"):
            r = convert_checkpoint(args.ckpt, args.out, cfg=cfg, int8_embedding=emb,
                                   overwrite=True, check=not args.no_check)  # ensure_out_dir: absent, empty or --force
    check = (f"; check on {r.tokens} tokens ({r.check_data}): logits SQNR {r.sqnr_db:.1f} dB, argmax agreement "
             f"{100 * r.argmax_agreement:.2f}%" if r.tokens else "")
    print(f"gptforge quantize: {r.int8_layers} INT8 layers{' + int8 embedding' if r.int8_embedding else ''}, "
          f"{r.int8_bytes / 2**20:.1f} MiB (fake-quant model {r.fake_quant_bytes / 2**20:.1f} MiB){check} -> {r.out_dir}")
    return 0


def _show(args, cfg) -> int:
    from gptforge.compress.int8_convert import summary
    from gptforge.model_io import load_model

    model, cfg = load_model(args.ckpt, cfg)
    rows = summary(model)
    if not rows:
        print(f"{args.ckpt}: no quantized layers (Compress.Quantization.enable is false)")
        return 0
    print(f"{'layer':28} {'reference':16} {'kind':10} {'weight':14} {'activation':32} {'act_scale':>10} {'pact':>8}")
    for r in rows:
        scale = f"{r['act_scale']:.4g}" if r["act_scale"] is not None else "-"
        pact = f"{r['pact_alpha']:.4g}" if r["pact_alpha"] is not None else "-"
        print(f"{r['name']:28} {r['reference']:16} {r['kind']:10} {r['weight']:14} {r['activation']:32} "
              f"{scale:>10} {pact:>8}")
    return 0
