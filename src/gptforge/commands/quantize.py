"""`gptforge quantize`: turn a QAT/PTQ model into a real INT8 model, quantize a float model's
weights (int8 / int4 / bf16, round-to-nearest or GPTQ), or show a model's quantization.

    gptforge quantize --ckpt runs/qat/step_400 --out runs/int8 --convert
    gptforge quantize --ckpt runs/pretrain --out runs/int4 --weights int4 --group-size 64 --method gptq
    gptforge quantize --ckpt runs/int8                      # per-layer table of a quantized model
    gptforge generate --ckpt runs/int8 ...; gptforge eval --ckpt runs/int8 ...

`--convert` writes int8 weights + fp32 steps (safetensors) and checks the INT8 model against the
fake-quant one on a batch (SQNR of the logits, greedy-argmax agreement: int8_report.json).
"""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, add_overwrite_arg
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
    w = p.add_argument_group("weight-only quantization of a float model (docs/quantize.md)")
    w.add_argument("--weights", choices=("int8", "int4", "bf16"), help="quantize the block Linears' weights to this "
                   "format and write the model to --out (activations stay float)")
    w.add_argument("--group-size", type=int, choices=(0, 32, 64, 128, 256), default=None,
                   help="input columns sharing one scale (and zero); 0 = one per output row. Default: 64 for int4, "
                        "0 for int8 (the packed int8 kernel's format)")
    w.add_argument("--method", choices=("rtn", "gptq", "awq"), default="rtn",
                   help="rtn: round to nearest (default); gptq: GPTQ error feedback, awq: activation-aware input "
                        "scales, both from calibration text")
    w.add_argument("--asym", action="store_true", help="asymmetric groups (an integer zero point per group)")
    w.add_argument("--head-bits", type=int, choices=(4, 8, 16, 32), default=None,
                   help="the tied embedding / LM head: 4 or 8 bits (same groups and method), 16 = bf16, "
                        "32 = float as trained (default 8; a mixed-precision plan chooses it)")
    w.add_argument("--avg-bits", type=float, metavar="B", help="mixed precision (with --weights int4): each block "
                   "Linear and the head at 4 or 8 bits, least summed sensitivity with at most B bits per weight "
                   "on average (scales excluded); writes quant_plan.json / quant_plan.md beside the model")
    w.add_argument("--max-bytes", type=int, metavar="N", help="mixed precision as --avg-bits, within N bytes of "
                   "model tensors (scales, biases and the rest included)")
    w.add_argument("--sensitivity", metavar="FILE", help="the analysis.json of `gptforge analyze --weights int4` "
                   "on this model (default: measure it now on the calibration text, KL to the float model)")
    w.add_argument("--calib", metavar="FILE", help="GPTQ/AWQ calibration text (UTF-8); default: the built-in corpus")
    w.add_argument("--samples", type=int, default=32, help="GPTQ/AWQ calibration windows (default 32)")
    w.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window (default 256, at most "
                   "the model's max_position_embeddings)")
    w.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening, a fraction of mean diag H (default 0.01; the tied head at least 0.5)")
    w.add_argument("--act-order", action="store_true", help="GPTQ: quantize columns by decreasing Hessian diagonal")
    w.add_argument("--clip-search", action="store_true", help="each group's range shrunk by the ratio in 1.0 ... 0.5 "
                   "with the smallest rounding error instead of its abs-max (rtn, gptq, awq; the plan's analysis too)")
    add_overwrite_arg(p)


def run(args: argparse.Namespace) -> int:
    from gptforge.commands.common import config_from_args, ensure_out_dir, require_ckpt

    require_ckpt(args)
    cfg = config_from_args(args)
    if args.weights is not None:
        return _weights(args, cfg)
    _refuse_weight_flags(args)
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
    if _show_weight_only(args.ckpt, model):
        return 0
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


def _refuse_weight_flags(args) -> None:
    given = [f for f, v in (("--group-size", args.group_size is not None), ("--method", args.method != "rtn"),
                            ("--asym", args.asym), ("--head-bits", args.head_bits is not None), ("--calib", args.calib),
                            ("--act-order", args.act_order), ("--clip-search", args.clip_search),
                            ("--avg-bits", args.avg_bits is not None),
                            ("--max-bytes", args.max_bytes is not None), ("--sensitivity", args.sensitivity)) if v]
    if given:
        raise UsageError(f"{given[0]} applies with --weights int8|int4|bf16")


def _weight_spec(args):
    """The spec of the --weights flags; left-out flags default to what a weight-only QAT model
    was trained for (`Compress.Quantization`), else int4 g64 / int8 per row, head 8 bits."""
    from gptforge.compress.weight_only_run import qat_weight_spec
    from gptforge.transforms.weight_only import WeightOnlySpec

    if args.act_order and args.method != "gptq":
        raise UsageError("--act-order applies with --method gptq")
    if args.convert:
        raise UsageError("--convert (INT8 from a QAT/PTQ model) and --weights (a float model's weights) "
                         "are separate runs; give one")
    if args.weights == "bf16" and (args.group_size or args.asym or args.method != "rtn" or args.clip_search):
        raise UsageError("--weights bf16 takes no --group-size / --asym / --method gptq|awq / --clip-search "
                         "(bf16 is a cast)")
    if args.method != "rtn" and (args.samples < 1 or args.seq_len < 1):
        raise UsageError(f"--samples {args.samples} / --seq-len {args.seq_len}: give positive counts")
    if not 0 < args.damp < 1:
        raise UsageError(f"--damp {args.damp}: give a fraction in (0, 1), e.g. 0.01")
    bits = {"int8": 8, "int4": 4, "bf16": 16}[args.weights]
    qat = qat_weight_spec(args.ckpt)
    if qat is not None and args.clip_search:
        raise UsageError(f"--clip-search: {args.ckpt} is a 4-bit QAT model, trained on its own grid (which quantize "
                         "keeps); leave --clip-search out")
    default = qat or WeightOnlySpec(bits=bits, group_size=64 if bits == 4 else 0, head_bits=8)
    return WeightOnlySpec(bits=bits, group_size=default.group_size if args.group_size is None else args.group_size,
                          sym=default.sym and not args.asym,
                          head_bits=default.head_bits if args.head_bits is None else args.head_bits,
                          method=args.method, clip=args.clip_search)


def _budget(args):
    """The mixed-precision budget of --avg-bits / --max-bytes (None without one)."""
    from gptforge.compress.weight_only_run import Budget

    if args.avg_bits is None and args.max_bytes is None:
        if args.sensitivity:
            raise UsageError("--sensitivity applies with --avg-bits B or --max-bytes N")
        return None
    if args.avg_bits is not None and args.max_bytes is not None:
        raise UsageError("--avg-bits and --max-bytes are two budgets; give one")
    if args.weights != "int4":
        raise UsageError("--avg-bits / --max-bytes give each layer 4 or 8 bits: use them with --weights int4")
    if args.head_bits is not None:
        raise UsageError("--head-bits: the mixed-precision plan chooses the head's bits (4 or 8); leave it out")
    if args.avg_bits is not None and not args.avg_bits >= 4:  # before any measuring
        raise UsageError(f"--avg-bits {args.avg_bits:g}: below 4, every layer's smallest width; give 4 <= B <= 8")
    if args.max_bytes is not None and args.max_bytes < 1:
        raise UsageError(f"--max-bytes {args.max_bytes}: give a positive byte count")
    return Budget(avg_bits=args.avg_bits, max_bytes=args.max_bytes, sensitivity=args.sensitivity)


def _weights(args, cfg) -> int:
    from gptforge.commands.common import ensure_out_dir
    from gptforge.compress.weight_only_run import quantize_weights
    from gptforge.run_lock import lock_output

    spec = _weight_spec(args)
    budget = _budget(args)
    if not args.out:
        raise UsageError("give the output directory with --out DIR")
    with lock_output(args.out, "quantize"):
        ensure_out_dir(args.out, args.force)
        r = quantize_weights(args.ckpt, args.out, spec, cfg=cfg, calib=args.calib, samples=args.samples,
                             seq_len=args.seq_len, damp=args.damp, act_order=args.act_order, overwrite=True,
                             budget=budget)
    fmt = args.weights + ("" if spec.bits == 16 else f" {'sym' if spec.sym else 'asym'} "
                          f"{'g' + str(spec.group_size) if spec.group_size else 'per row'}")
    if r.plan is not None:
        p = r.plan
        n8 = sum(b == 8 for b in p.layer_bits.values())
        rows = f" with its {len(p.head_rows8)} most used rows at 8" if p.head_rows8 else ""
        head = f"mixed 4/8 bits ({p.budget}: {n8} of {len(p.rows)} layers at 8 bits, " \
               f"head {p.layer_bits['wte']} bits{rows}; plan in quant_plan.md)"
    else:
        head = f"head {spec.head_bits} bits"
    method = ("the QAT model's learned scales" if r.learned_scales
              else spec.method + (", clip-searched grids" if spec.clip else ""))
    print(f"gptforge quantize: weights {fmt} ({method}), {head}: {r.avg_bits:.3f} bits per planned weight "
          f"({r.stored_bits:.3f} stored with scales), {r.quantized_bytes / 2**20:.2f} MiB (float "
          f"{r.float_bytes / 2**20:.2f} MiB)"
          f"{'; calibration ' + r.calibration if spec.method != 'rtn' else ''} -> {r.out_dir}")
    return 0


def _show_weight_only(ckpt, model) -> bool:
    """The per-layer table of a weight-only directory (format and the kernel a one-row call takes)."""
    import torch

    from gptforge.model_io import resolve_checkpoint_path
    from gptforge.transforms.weight_only import read_spec, weight_only_layers

    path = resolve_checkpoint_path(ckpt)
    spec = read_spec(path) if path.is_dir() else None
    if spec is None:
        return False
    print(f"{path}: weight-only {spec.method} (weight_only.json)")
    print(f"{'layer':28} {'shape':>14} {'format':24} {'kernel (1 row)':>14}")
    for name, mod in weight_only_layers(model):
        fmt = mod.extra_repr().split(", ", 2)[2]
        x = torch.zeros(1, mod.in_features)
        print(f"{name:28} {f'{mod.out_features}x{mod.in_features}':>14} {fmt:24} {mod.kernel_for(x):>14}")
    return True
