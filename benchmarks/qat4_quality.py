"""4-bit weight-only QAT vs int4 PTQ (RTN, GPTQ) on held-out bits per byte (issue #32's QAT line).

`lowbit_quality.py`'s set-up, imported: the same float model (trained once by it on the built-in
corpus, `--steps`), held-out text from the same Eval-split documents (`--heldout-chars`, 400,000
by default: on 40,000 the text's chance moved one model's int4 loss by as much as QAT gains) and
the same scoring (`gptforge eval`, WikiText method). Once, for each head bit-width in `--head-bits`: int4 g64 RTN
and int4 g64 GPTQ of the float model (`gptforge quantize --weights int4`). Then for each seed in
`--seeds` (`Global.seed`: the order of the fine-tuning batches; QAT and its control share it):
  - the control: the float model fine-tuned for `--qat-steps` steps at the same lr (so a gain is
    not just more training), plus its int4 g64 RTN at each head width;
  - QAT: `gptforge qat`'s code from the float model for the same steps with
    `Compress.Quantization.weight_only` (int4, group 64, symmetric, the head at that width), then
    `gptforge quantize --weights int4` of the QAT checkpoint (round-to-nearest on the trained
    grid), scored as the weight-only model a user would run.
Recovery against the control (the acceptance number): (RTN(control) - QAT) / (RTN(control) - control),
all in held-out bits per byte; per seed, then the median and the minimum over the seeds. Also
printed: recovery against the float model's own RTN / GPTQ, (PTQ - QAT) / (PTQ - float), which
credits QAT with the extra training. Goal: >= 90% of PTQ's loss recovered.

`--distill`: QAT trained toward the float model it starts from (`Compress.Quantization.distill`,
`Engine.distill.alpha` = `--alpha`, temperature `--temperature`) instead of the LM loss. Its
model stays near the float one rather than training on, so the float model itself is the
baseline and no control is trained: recovery = (PTQ(float) - QAT) / (PTQ(float) - float), PTQ =
the float model's int4 g64 RTN (the acceptance number) and GPTQ (where it costs anything).

    .venv/bin/python benchmarks/qat4_quality.py [--work runs/bench_lowbit] [--steps 1000] [--qat-steps 200]
        [--lr 6e-4] [--min-lr 0.1] [--seeds 1024 1 2] [--distill [--alpha 1] [--temperature 1]] [--learn-scales [--scale-lr-mult 50]]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from gptforge.config import load_config  # noqa: E402
from lowbit_quality import cli, heldout_text, score, train  # noqa: E402  (benchmarks/ is on sys.path)
from qat_quality import cpu_flags, cpu_name, overrides, run_dir, tokenizer  # noqa: E402

INT4 = ["--weights", "int4", "--group-size", "64"]
GOAL = 0.9


def quantize(src: Path, out: Path, flags: list, args) -> Path:
    if not (out / "weight_only.json").is_file():
        cli("quantize", "--ckpt", src, "--out", out, "--force", *flags, "--samples", args.samples, "--seq-len",
            args.seq, "--no-progress")
    return out


def finetune(work: Path, tok, tok_dir: Path, ckpt: Path, args, seed: int, name: str, extra: list[str]) -> Path:
    """`--qat-steps` more steps from `ckpt` (lr `--lr` cosine to `--min-lr` x lr, batches in `seed`'s order):
    QAT with `extra` quantization keys, or plain float fine-tuning (extra empty)."""
    from gptforge.compress.qat import qat
    from gptforge.train import pretrain

    out = work / name
    if run_dir(out, args.qat_steps) is None:
        shutil.rmtree(out, ignore_errors=True)
        cfg = load_config(overrides=[*overrides(tok_dir, args, out, args.qat_steps, args.lr, args.lr * args.min_lr, 0.0),
                                     "Optimizer.weight_decay=0.0", f"Compress.pretrained={ckpt}",
                                     f"Global.seed={seed}", *extra])
        t0 = time.perf_counter()
        (qat if extra else pretrain)(cfg, tokenizer=tok, progress=False, echo=False)
        print(f"seed {seed} {name}: {args.qat_steps} steps in {time.perf_counter() - t0:.0f}s", file=sys.stderr,
              flush=True)
    return run_dir(out, args.qat_steps)


def qat_keys(head_bits: int, args=None) -> list[str]:
    lsq = (["Compress.Quantization.learn_scales=True", f"Compress.Quantization.scale_lr_mult={args.scale_lr_mult}"]
           if args is not None and args.learn_scales else [])
    return ["Compress.Quantization.weight_only=True", "Compress.Quantization.weight_bits=4",
            "Compress.Quantization.group_size=64", f"Compress.Quantization.head_bits={head_bits}", *lsq]


@torch.no_grad()
def logits_gap(fake_quant: Path, converted: Path, tok, text: Path) -> dict:
    """Max |logit difference| between the QAT checkpoint (fake quant) and its weight-only model on
    one window of held-out tokens, for each kernel the weight-only model can take here."""
    from gptforge.model_io import load_model
    from gptforge.transforms.weight_only import KERNEL_ENV

    fq = load_model(fake_quant)[0]
    ids = torch.tensor(tok.encode(text.read_text())[: 2 * 128]).reshape(2, 128)
    ref = fq(ids).logits
    gaps = {"logit_absmax": float(ref.abs().max())}
    for kern in ("fp32", "auto"):
        os.environ[KERNEL_ENV] = kern
        gaps[kern] = float((load_model(converted)[0](ids).logits - ref).abs().max())
    os.environ.pop(KERNEL_ENV)
    return gaps


def recovery(ptq_inc: float, qat_inc: float) -> float:
    """Share of PTQ's increase (over a reference) that QAT's model does not have; nan when PTQ
    costs nothing (nothing to recover)."""
    return (ptq_inc - qat_inc) / ptq_inc if ptq_inc > 0 else float("nan")


def aggregate(per_seed: dict[int, dict], goal: float = GOAL, distill: bool = False) -> dict:
    """Per-seed recoveries (against the control; with `distill` against the float model's RTN)
    -> their median, minimum and the verdict: met on every seed, met by the median only, or not
    met (a seed without a measurable PTQ loss, nan, counts as not assessable and is left out of
    the median). Also `pooled`: the recovery of the seeds' mean losses, (mean PTQ loss - mean QAT
    loss) / mean PTQ loss, steadier than a ratio of one seed's small differences."""
    recs = {s: r["recovery_vs_rtn" if distill else "recovery_vs_control"] for s, r in per_seed.items()}
    mean = statistics.fmean
    def base(r: dict) -> float:  # the reference the increases are measured from
        return 0.0 if distill else r["control_inc"]

    ptq_key = "rtn_inc" if distill else "control_rtn_inc"
    pooled = recovery(mean(r[ptq_key] - base(r) for r in per_seed.values()),
                      mean(r["qat_inc"] - base(r) for r in per_seed.values()))
    vals = [v for v in recs.values() if v == v]
    if not vals:
        return {"per_seed": recs, "median": float("nan"), "min": float("nan"), "pooled": pooled,
                "verdict": "not assessable"}
    med, low = statistics.median(vals), min(vals)
    verdict = ("met on every seed" if low >= goal and len(vals) == len(recs)
               else f"median met (min {100 * low:.0f}%)" if med >= goal else "not met")
    return {"per_seed": recs, "median": med, "min": low, "pooled": pooled, "verdict": verdict}


class Scorer:
    """Scores a model directory once (the eval JSON is kept beside the runs and reused) and keeps
    every row for the results file."""

    def __init__(self, text: Path, seq: int, chars: int = 40_000):
        self.text, self.seq, self.rows = text, seq, {}
        # scores on another text are kept apart (the earlier runs' files are the 40,000-char text's)
        self.suffix = "" if chars == 40_000 else f"_{chars}"

    def __call__(self, name: str, path: Path, where: Path, prefix: str = "") -> float:
        out = where / f"{name.replace(' ', '_')}_eval{self.suffix}.json"
        m = json.loads(out.read_text())["metrics"] if out.is_file() else score(path, self.text, out, self.seq)
        self.rows[prefix + name] = {"bits_per_byte": m["bits_per_byte"], "ppl": m["ppl"], "path": str(path)}
        print(f"{prefix + name:48} bpb {m['bits_per_byte']:.4f}  ppl {m['ppl']:.3f}", flush=True)
        return m["bits_per_byte"]


def seed_run(seed: int, sub: Path, ckpt: Path, ptq: dict, row: Scorer, tok, tok_dir: Path, text: Path,
             args) -> dict:
    """Control and QAT for one seed: {head bits: increases over the float model and recoveries}."""
    sd = sub / f"seed{seed}"
    sd.mkdir(parents=True, exist_ok=True)
    f = ptq["float"]
    ctrl = finetune(sd, tok, tok_dir, ckpt, args, seed, "control_float_ft", [])
    tag = f"seed {seed}: "
    c = row(f"float fine-tuned {args.qat_steps} steps (control)", ctrl, sd, tag)
    out = {}
    for hb in args.head_bits:
        crtn = row(f"control int4 g64 RTN, head {hb}",
                   quantize(ctrl, sd / f"control_RTN_head{hb}", [*INT4, "--head-bits", str(hb)], args), sd, tag)
        qdir = finetune(sd, tok, tok_dir, ckpt, args, seed, f"qat_int4_g64_head{hb}", qat_keys(hb, args))
        conv = quantize(qdir, sd / f"qat_int4_g64_head{hb}_int4", ["--weights", "int4"], args)
        q = row(f"QAT int4 g64, head {hb} (converted)", conv, sd, tag)
        rtn, gptq = ptq[hb]["rtn"], ptq[hb]["gptq"]
        out[hb] = {"qat_inc": q - f, "control_inc": c - f, "control_rtn_inc": crtn - f,
                   "recovery_vs_rtn": recovery(rtn - f, q - f), "recovery_vs_gptq": recovery(gptq - f, q - f),
                   "recovery_vs_control": recovery(crtn - c, q - c), "logits_gap": logits_gap(qdir, conv, tok, text)}
        s = out[hb]
        print(f"seed {seed}, head {hb}: QAT {s['qat_inc']:+.4f} over float (control {s['control_inc']:+.4f}, "
              f"control RTN {s['control_rtn_inc']:+.4f}): recovers {100 * s['recovery_vs_control']:.0f}% against "
              f"the control ({100 * s['recovery_vs_rtn']:.0f}% of the float model's RTN increase); fake-quant vs "
              f"converted logits max |diff| fp32 {s['logits_gap']['fp32']:.1e}, auto {s['logits_gap']['auto']:.1e}",
              flush=True)
    return out


def distill_seed_run(seed: int, sub: Path, ckpt: Path, ptq: dict, row: Scorer, tok, tok_dir: Path, text: Path,
                     args) -> dict:
    """`--distill`: QAT toward the float model for one seed, no control: {head bits: increases
    over the float model and recoveries against its RTN / GPTQ}."""
    sd = sub / f"seed{seed}"
    sd.mkdir(parents=True, exist_ok=True)
    f, out = ptq["float"], {}
    kd = ["Compress.Quantization.distill=True", f"Engine.distill.alpha={args.alpha}",
          f"Engine.distill.temperature={args.temperature}"]
    for hb in args.head_bits:
        qdir = finetune(sd, tok, tok_dir, ckpt, args, seed, f"kdqat_int4_g64_head{hb}", [*qat_keys(hb, args), *kd])
        conv = quantize(qdir, sd / f"kdqat_int4_g64_head{hb}_int4", ["--weights", "int4"], args)
        q = row(f"KD-QAT int4 g64, head {hb} (converted)", conv, sd, f"seed {seed}: ")
        rtn, gptq = ptq[hb]["rtn"] - f, ptq[hb]["gptq"] - f
        out[hb] = {"qat_inc": q - f, "rtn_inc": rtn, "gptq_inc": gptq, "recovery_vs_rtn": recovery(rtn, q - f),
                   "recovery_vs_gptq": recovery(gptq, q - f), "logits_gap": logits_gap(qdir, conv, tok, text)}
        s = out[hb]
        print(f"seed {seed}, head {hb}: KD-QAT {s['qat_inc']:+.4f} over float (RTN {rtn:+.4f}, GPTQ {gptq:+.4f}): "
              f"recovers {100 * s['recovery_vs_rtn']:.0f}% of RTN's increase, "
              f"{100 * s['recovery_vs_gptq']:.0f}% of GPTQ's; fake-quant vs converted logits max |diff| fp32 "
              f"{s['logits_gap']['fp32']:.1e}, auto {s['logits_gap']['auto']:.1e}", flush=True)
    return out


def ptq_rows(work: Path, ckpt: Path, row: Scorer, args) -> dict:
    """The float model's score and its int4 g64 RTN / GPTQ per head width (shared by every run
    with other QAT settings)."""
    ptq = work / f"qat4_p{args.steps}_ptq"
    ptq.mkdir(exist_ok=True)
    res: dict = {"float": row("float", ckpt, ptq)}
    for hb in args.head_bits:
        head = ["--head-bits", str(hb)]
        res[hb] = {"rtn": row(f"int4 g64 RTN, head {hb}", quantize(ckpt, ptq / f"int4_g64_RTN_head{hb}",
                                                                     [*INT4, *head], args), ptq),
                   "gptq": row(f"int4 g64 GPTQ, head {hb}", quantize(ckpt, ptq / f"int4_g64_GPTQ_head{hb}",
                                                                       [*INT4, "--method", "gptq", *head], args), ptq)}
    return res


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench_lowbit", help="shared with lowbit_quality.py (its float model)")
    ap.add_argument("--steps", type=int, default=1000, help="float pretraining steps (lowbit_quality.py's)")
    ap.add_argument("--qat-steps", type=int, default=200, help="QAT steps, and the control's fine-tuning steps")
    ap.add_argument("--lr", type=float, default=6e-4, help="max lr of QAT and of the control")
    ap.add_argument("--min-lr", type=float, default=0.1,
                    help="the cosine's end as a fraction of --lr (0: decay to zero, which lets the rounding settle)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1024],
                    help="Global.seed of QAT and its control (batch order); 1024 is the config default")
    ap.add_argument("--head-bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--samples", type=int, default=64, help="GPTQ calibration windows")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--distill", action="store_true",
                    help="QAT toward the float model (Compress.Quantization.distill); recovery against the float "
                         "model's RTN / GPTQ, no control")
    ap.add_argument("--alpha", type=float, default=1.0, help="--distill: Engine.distill.alpha (1: KL only)")
    ap.add_argument("--temperature", type=float, default=1.0, help="--distill: Engine.distill.temperature")
    ap.add_argument("--learn-scales", action="store_true",
                    help="QAT learns each group's scale too (Compress.Quantization.learn_scales)")
    ap.add_argument("--scale-lr-mult", type=float, default=50.0, help="--learn-scales: Compress.Quantization.scale_lr_mult")
    ap.add_argument("--device", default="cpu", help="where the float model and the fine-tunes train (cpu, cuda); quantize / eval run where the CLI puts them")
    ap.add_argument("--heldout-chars", type=int, default=400_000,
                    help="held-out text: whole Eval-split documents up to this many characters (the 40,000 of the "
                         "runs before 2026-11-27 left the seeds' int4 losses scattered by the text's chance)")
    ap.add_argument("--out", help="write the results (JSON) here too")
    ap.add_argument("--quick", action="store_true", help="tiny run to check the script (numbers meaningless)")
    args = ap.parse_args(argv)
    if args.quick:  # scoring int4 models dominates a quick run: a tenth of the held-out text
        args.steps, args.qat_steps, args.head_bits, args.samples, args.heldout_chars = 10, 2, [4], 4, 4_000
    return args


def report(args, per_seed: dict, ptq: dict, t_start: float) -> dict:
    print(f"\nmachine: {cpu_name()} ({cpu_flags()}), {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}; total {time.perf_counter() - t_start:.0f}s")
    kd = (f"distillation from the float model (alpha {args.alpha:g}, temperature {args.temperature:g}), no control"
          if args.distill else "LM loss; the control the same")
    lsq = f", learned scales (lr x {args.scale_lr_mult:g})" if args.learn_scales else ""
    print(f"QAT: {args.qat_steps} steps, batch {args.batch} x {args.seq}, lr {args.lr:g} cosine to "
          f"{args.lr * args.min_lr:g}, no warmup, weight decay 0, {kd}{lsq}; seeds {' '.join(map(str, args.seeds))}")
    summary = {}
    for hb in args.head_bits:
        agg = aggregate({s: r[hb] for s, r in per_seed.items()}, distill=args.distill)
        summary[hb] = agg
        f = ptq["float"]
        print(f"head {hb}: float model's RTN {ptq[hb]['rtn'] - f:+.4f}, GPTQ {ptq[hb]['gptq'] - f:+.4f}; recovery "
              f"against {'the float model' + chr(39) + 's RTN' if args.distill else 'the control'} per seed "
              f"{', '.join(f'{s}: {100 * v:.0f}%' for s, v in agg['per_seed'].items())}; median "
              f"{100 * agg['median']:.0f}%, min {100 * agg['min']:.0f}%, pooled {100 * agg['pooled']:.0f}% (goal >= {100 * GOAL:.0f}%: {agg['verdict']})")
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t_start = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok, tok_dir = tokenizer(work)
    ckpt, cfg = train(work, tok, tok_dir, args)
    text = heldout_text(work, tok, cfg, args.heldout_chars)
    row = Scorer(text, args.seq, args.heldout_chars)
    ptq = ptq_rows(work, ckpt, row, args)
    sub = work / f"qat4_p{args.steps}_s{args.qat_steps}_lr{args.lr:g}"
    if args.min_lr != 0.1:  # the earlier runs' directories (cosine to lr/10) keep their names
        sub = sub.with_name(f"{sub.name}_min{args.min_lr:g}")
    if args.distill:
        sub = sub.with_name(f"{sub.name}_kd_a{args.alpha:g}_T{args.temperature:g}")
    if args.learn_scales:
        sub = sub.with_name(f"{sub.name}_lsq{args.scale_lr_mult:g}")
    run = distill_seed_run if args.distill else seed_run
    per_seed = {s: run(s, sub, ckpt, ptq, row, tok, tok_dir, text, args) for s in args.seeds}
    summary = report(args, per_seed, ptq, t_start)
    rec = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args),
           "heldout_chars": len(text.read_text()), "rows": row.rows, "ptq": ptq, "per_seed": per_seed,
           "summary": summary}
    (sub / "qat4_quality.json").write_text(json.dumps(rec, indent=2) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")


if __name__ == "__main__":
    main()
