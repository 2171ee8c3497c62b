"""`gptforge analyze`: per-layer quantization sensitivity (spec §9, PaddleSlim AnalysisQAT).

    gptforge analyze --ckpt output_qat --float-ckpt runs/float/step_1000 --eval-path lambada_test.jsonl \\
        -o Offline_Eval.cloze_eval=True --top-k 7
    gptforge analyze --ckpt output_qat --float-ckpt runs/float/step_1000 --metric loss --batches 16
    gptforge analyze --ckpt output_qat --metric cosine          # no eval set: the output-distance proxy
    gptforge analyze --mode ptq --ckpt runs/float/step_1000 --metric kl
    gptforge analyze --ckpt runs/float --weights int4 --group-size 64 --method gptq   # weight-only, per layer

`--ckpt` is the model analysed: in qat mode the fake-quant model (= --qat-ckpt); in ptq mode a
float model is quantized and calibrated here (= --float-ckpt), a PTQ/QAT model is used as it is
(= --qat-ckpt).

Writes <out>/analysis.txt (the reference's lines, most sensitive first), analysis.json (both
layer names, values; also the resumable progress), analysis.png (the ranking) and, with
--top-k N, skip_tensor_map.yaml plus the `-o` override and `gptforge qat` command that re-run
QAT with those layers float. An interrupted run resumes where it stopped.

`--weights int4` analyses a float model for weight-only quantization instead: each block Linear's
and the head's increase in KL to the float model (or loss) with only it rounded to 4 and to 8
bits, on calibration text; `quantize --avg-bits / --max-bytes --sensitivity <out>/analysis.json`
plans each layer's bits from it (compress/sensitivity_weights.py, compress/bit_plan.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gptforge.commands.common import add_config_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Quantization sensitivity: for each quantized Linear, evaluate the model with that layer's "
                     "quantization off (qat mode; weight restored from the float baseline, as PaddleSlim's "
                     "AnalysisQAT) or with only that layer quantized (ptq mode), rank the layers and write the "
                     "skip list for the next QAT run.")
    add_config_args(p, ckpt=False)
    p.add_argument("--ckpt", metavar="DIR", help=(
        "the model to analyse; its config and tokenizer are used, so -c is optional. qat mode: the fake-quant "
        "model (= --qat-ckpt); ptq mode: a float model (= --float-ckpt) or a PTQ/QAT model (= --qat-ckpt)"))
    p.add_argument("--qat-ckpt", metavar="DIR", help=(
        "the fake-quant model to analyse: a QAT checkpoint (step_N or a run directory) or a PTQ directory"))
    p.add_argument("--float-ckpt", metavar="DIR", help=(
        "the float baseline (the model QAT started from): qat mode copies its weight into each de-quantized layer "
        "and measures its metric; ptq mode quantizes and calibrates it"))
    p.add_argument("--mode", choices=("qat", "ptq"), default=None, help=(
        "qat (default): leave one layer's quantization out at a time; ptq: quantize only one layer at a time"))
    p.add_argument("--metric", default="auto", choices=("auto", "acc", "ppl", "loss", "cosine", "kl"), help=(
        "acc: LAMBADA accuracy x100; ppl: WikiText perplexity (both on Offline_Eval.eval_path); loss: mean token "
        "loss on Eval-split batches; cosine / kl: distance of the logits to the float model's on Train-split "
        "batches. auto: acc or ppl (by Offline_Eval.cloze_eval) when an eval file is set, else cosine"))
    p.add_argument("--eval-path", metavar="FILE", help="= -o Offline_Eval.eval_path=FILE")
    p.add_argument("--batches", type=int, metavar="N", help=(
        "batches for loss (default Engine.eval_iters) and cosine/kl (default Compress.Quantization.calib_batches)"))
    p.add_argument("--layers", nargs="+", metavar="NAME", help=(
        "analyse only these layers: our names, linear_N names or globs (blocks.*.linear2)"))
    p.add_argument("--top-k", type=int, metavar="N", help=(
        "write skip_tensor_map.yaml leaving the N most sensitive layers float, and print the -o override and "
        "gptforge qat command"))
    p.add_argument("--out", default="analysis_results", metavar="DIR", help="output directory (default: %(default)s)")
    p.add_argument("--force", "--no-resume", dest="force", action="store_true", help=(
        "start over in --out, replacing the analysis there (default: resume an analysis of the same inputs; "
        "refuse one of other inputs, or analysis files without one; --no-resume: the older spelling)"))
    p.add_argument("--no-plot", action="store_true", help="do not write analysis.png")
    p.add_argument("--show", type=int, default=20, metavar="N", help="rows of the ranking printed (default 20; 0 = all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    w = p.add_argument_group("weight-only sensitivity of a float model (docs/analyze.md, docs/quantize.md)")
    w.add_argument("--weights", choices=("int4",), help=(
        "for each block Linear and the tied embedding / head, the increase in --metric (kl, default, or loss) with "
        "only that layer's weights rounded to 4 bits and to 8 bits, everything else float; writes analysis.txt "
        "and analysis.json for `quantize --avg-bits/--max-bytes --sensitivity`"))
    w.add_argument("--group-size", type=int, choices=(0, 32, 64, 128, 256), default=64,
                   help="input columns sharing one scale, as quantize will use (default 64)")
    w.add_argument("--method", choices=("rtn", "gptq"), default="rtn", help="how each layer is rounded (default rtn)")
    w.add_argument("--asym", action="store_true", help="asymmetric groups, as quantize --asym")
    w.add_argument("--calib", metavar="FILE", help="calibration text (UTF-8); default: the built-in corpus")
    w.add_argument("--samples", type=int, default=32, help="calibration windows (default 32)")
    w.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    w.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening, a fraction of mean diag H (default 0.01; the tied head at least 0.5)")
    w.add_argument("--clip-search", action="store_true", help="round on clip-searched group grids, as quantize "
                   "--clip-search will")


def run(args: argparse.Namespace) -> int:
    from gptforge.compress.sensitivity_report import table_lines
    from gptforge.compress.sensitivity_run import run_analysis
    from gptforge.errors import UsageError
    from gptforge.model_io import load_run_config

    if args.weights:
        return _weights(args)
    _refuse_weight_flags(args)
    args.mode = args.mode or "qat"
    _place_ckpt(args)
    if not args.qat_ckpt and not args.float_ckpt:
        raise UsageError("give the model to analyse with --ckpt DIR (a QAT/PTQ model; --mode ptq: a float model)")
    _check_out(args)
    overrides = list(args.override)
    if args.eval_path:
        overrides.append(f"Offline_Eval.eval_path={args.eval_path}")
    cfg = load_run_config(args.config, overrides, ckpt_dir=args.qat_ckpt or args.float_ckpt)
    from gptforge.run_lock import lock_dir

    with lock_dir(args.out, "analyze"):  # one analysis per output directory at a time
        res = run_analysis(cfg, qat_ckpt=args.qat_ckpt, float_ckpt=args.float_ckpt, mode=args.mode,
                           metric=args.metric, out_dir=args.out, batches=args.batches, layers=args.layers,
                           top_k=args.top_k, resume=not args.force, plot=not args.no_plot,
                           progress=not args.no_progress, config_file=args.config)
    a = res.analysis
    base = "QAT model" if a.mode == "qat" else "float model"
    head = f"gptforge analyze: {a.mode} mode, {a.metric_label}: {base} {a.base_value:.6g}"
    if a.mode == "qat" and a.float_value is not None:
        head += f", float baseline {a.float_value:.6g}"
    print(head + (f" ({a.resumed} layers resumed)" if a.resumed else ""))
    for line in table_lines(a, args.show or None):
        print(line)
    for note in res.notes:
        print(f"note: {note}")
    print("wrote " + ", ".join(str(p) for p in res.files.values()))
    if res.top_k is None:
        if res.suggested_k:
            print(f"the top {res.suggested_k} layers carry half of the positive sensitivity; "
                  f"--top-k {res.suggested_k} writes their skip_tensor_map")
    else:
        print(f"skip the top {res.top_k} in the next QAT run: -o {res.override}")
        print(f"  {res.qat_command}")
    return 0


def _place_ckpt(args: argparse.Namespace) -> None:
    """`--ckpt` as --qat-ckpt or --float-ckpt: a fake-quant model is the one analysed as it is; a
    float model is the one ptq mode quantizes (in qat mode it cannot be the model analysed)."""
    from gptforge.errors import UsageError

    if not args.ckpt:
        return
    from gptforge.model_io import read_checkpoint_config

    raw = read_checkpoint_config(args.ckpt)  # a run directory: its newest step
    quantized = bool(((raw.get("Compress") or {}).get("Quantization") or {}).get("enable"))
    key = "qat_ckpt" if quantized or args.mode == "qat" else "float_ckpt"
    if getattr(args, key):
        raise UsageError(f"--ckpt and --{key.replace('_', '-')} both name the model to analyse; give one")
    setattr(args, key, args.ckpt)


def _refuse_weight_flags(args: argparse.Namespace) -> None:
    from gptforge.errors import UsageError

    given = [f for f, v in (("--group-size", args.group_size != 64), ("--method", args.method != "rtn"),
                            ("--asym", args.asym), ("--calib", args.calib), ("--samples", args.samples != 32),
                            ("--seq-len", args.seq_len != 256), ("--damp", args.damp != 0.01),
                            ("--clip-search", args.clip_search)) if v]
    if given:
        raise UsageError(f"{given[0]} applies with --weights int4 (weight-only sensitivity)")


def _weights(args: argparse.Namespace) -> int:
    """`analyze --weights int4`: the weight-only sensitivity of a float model."""
    from gptforge.commands.common import config_from_args
    from gptforge.compress.sensitivity_weights_run import run_weight_analysis
    from gptforge.errors import UsageError
    from gptforge.run_lock import lock_dir
    from gptforge.transforms.weight_only import WeightOnlySpec

    bad = [f for f, v in (("--mode", args.mode), ("--qat-ckpt", args.qat_ckpt), ("--float-ckpt", args.float_ckpt),
                          ("--eval-path", args.eval_path), ("--layers", args.layers), ("--top-k", args.top_k),
                          ("--batches", args.batches)) if v]
    if bad:
        raise UsageError(f"{bad[0]} does not apply with --weights int4 (give the float model with --ckpt, the text "
                         "with --calib / --samples / --seq-len)")
    if not args.ckpt:
        raise UsageError("give the float model to analyse with --ckpt DIR")
    metric = "kl" if args.metric == "auto" else args.metric
    if metric not in ("kl", "loss"):
        raise UsageError(f"--metric {metric}: --weights int4 measures kl (default) or loss")
    if args.samples < 1 or args.seq_len < 2:
        raise UsageError(f"--samples {args.samples} / --seq-len {args.seq_len}: give at least 1 window of 2 tokens")
    if not 0 < args.damp < 1:
        raise UsageError(f"--damp {args.damp}: give a fraction in (0, 1), e.g. 0.01")
    _check_out(args)
    cfg = config_from_args(args)
    spec = WeightOnlySpec(bits=4, group_size=args.group_size, sym=not args.asym, method=args.method,
                          clip=args.clip_search)
    with lock_dir(args.out, "analyze"):
        r = run_weight_analysis(args.ckpt, args.out, spec, cfg=cfg, calib=args.calib, samples=args.samples,
                                seq_len=args.seq_len, metric=metric, method=args.method, damp=args.damp,
                                resume=not args.force, progress=not args.no_progress)
    a = r.analysis
    print(f"gptforge analyze: weight-only int4 {'g' + str(args.group_size) if args.group_size else 'per row'} "
          f"({args.method}{', clip-searched grids' if args.clip_search else ''}), {a.metric_label}; calibration {r.calibration}"
          + (f" ({a.resumed} layers resumed)" if a.resumed else ""))
    lines = (r.files["txt"]).read_text(encoding="utf-8").splitlines()[2:]
    notes = [ln for ln in lines[1:] if ln.startswith("#")]  # the head-row ladder, after the ranking
    lines = [ln for ln in lines if ln not in notes]
    show = args.show or len(lines)
    print("\n".join(lines[:show + 1]))
    if len(lines) > show + 1:
        print(f"      ... {len(lines) - show - 1} more in {r.files['txt']}")
    if notes:
        print("\n".join(notes))
    print("wrote " + ", ".join(str(p) for p in r.files.values()))
    print(f"plan from it: gptforge quantize --ckpt {args.ckpt} --weights int4 --group-size {args.group_size} "
          f"--avg-bits 4.5 --sensitivity {r.files['json']} --out DIR")
    return 0


def _check_out(args: argparse.Namespace) -> None:
    """Before any model loads: `--out` is a directory whose analysis files belong to an analysis
    (analysis.json: resumed, or refused by run_analysis when its inputs differ) or are absent,
    unless --force."""
    from gptforge.commands.common import refuse_existing
    from gptforge.compress import sensitivity_report as rep
    from gptforge.errors import UsageError

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, expected a directory; choose another --out")
    if not (out / rep.JSON_FILE).is_file():
        refuse_existing([out / name for name in (rep.TXT, rep.PNG, rep.SKIP_YAML)], args.force)
