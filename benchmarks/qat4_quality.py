"""4-bit weight-only QAT vs int4 PTQ (RTN, GPTQ) on held-out bits per byte (issue #32's QAT line).

`lowbit_quality.py`'s set-up, imported: the same float model (trained by it on the built-in
corpus, `--steps`), the same held-out text (Eval-split documents) and the same scoring
(`gptforge eval`, WikiText method). Then, for each head bit-width in `--head-bits`:
  - int4 g64 RTN and int4 g64 GPTQ of the float model (`gptforge quantize --weights int4`);
  - QAT: `gptforge qat`'s code from the float model for `--qat-steps` steps with
    `Compress.Quantization.weight_only` (int4, group 64, symmetric, the head at that width),
    then `gptforge quantize --weights int4` of the QAT checkpoint (round-to-nearest on the
    trained grid), scored as the weight-only model a user would run;
and once, the control: the float model fine-tuned for the same steps at the same lr (so a gain
is not just more training), plus its int4 g64 RTN at each head width.
Recovery = (PTQ increase - QAT increase) / PTQ increase, increases over the float model, against
RTN and against GPTQ; and against the control: (RTN(control) - QAT) / (RTN(control) - control).
Goal: >= 90% of PTQ's loss recovered.

    .venv/bin/python benchmarks/qat4_quality.py [--work runs/bench_lowbit] [--steps 1000] [--qat-steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from gptforge.config import load_config  # noqa: E402
from lowbit_quality import cli, heldout_text, score, train  # noqa: E402  (benchmarks/ is on sys.path)
from qat_quality import cpu_flags, cpu_name, overrides, run_dir, tokenizer  # noqa: E402

INT4 = ["--weights", "int4", "--group-size", "64"]


def quantize(src: Path, out: Path, flags: list, args) -> Path:
    if not (out / "weight_only.json").is_file():
        cli("quantize", "--ckpt", src, "--out", out, "--force", *flags, "--samples", args.samples, "--seq-len",
            args.seq, "--no-progress")
    return out


def finetune(work: Path, tok, tok_dir: Path, ckpt: Path, args, name: str, extra: list[str]) -> Path:
    """`--qat-steps` more steps from `ckpt` (lr `--lr` cosine to lr/10): QAT with `extra`
    quantization keys, or plain float fine-tuning (extra empty)."""
    from gptforge.compress.qat import qat
    from gptforge.train import pretrain

    out = work / name
    if run_dir(out, args.qat_steps) is None:
        shutil.rmtree(out, ignore_errors=True)
        cfg = load_config(overrides=[*overrides(tok_dir, args, out, args.qat_steps, args.lr, args.lr / 10, 0.0),
                                     "Optimizer.weight_decay=0.0", f"Compress.pretrained={ckpt}", *extra])
        t0 = time.perf_counter()
        (qat if extra else pretrain)(cfg, tokenizer=tok, progress=False, echo=False)
        print(f"{name}: {args.qat_steps} steps in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return run_dir(out, args.qat_steps)


def qat_keys(head_bits: int) -> list[str]:
    return ["Compress.Quantization.weight_only=True", "Compress.Quantization.weight_bits=4",
            "Compress.Quantization.group_size=64", f"Compress.Quantization.head_bits={head_bits}"]


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
    return (ptq_inc - qat_inc) / ptq_inc if ptq_inc > 0 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench_lowbit", help="shared with lowbit_quality.py (its float model)")
    ap.add_argument("--steps", type=int, default=1000, help="float pretraining steps (lowbit_quality.py's)")
    ap.add_argument("--qat-steps", type=int, default=200, help="QAT steps, and the control's fine-tuning steps")
    ap.add_argument("--lr", type=float, default=2e-4, help="max lr of QAT and of the control (cosine to lr/10)")
    ap.add_argument("--head-bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--samples", type=int, default=64, help="GPTQ calibration windows")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", help="write the results (JSON) here too")
    ap.add_argument("--quick", action="store_true", help="tiny run to check the script (numbers meaningless)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.qat_steps, args.head_bits, args.samples = 10, 2, [4], 4
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t_start = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok, tok_dir = tokenizer(work)
    ckpt, cfg = train(work, tok, tok_dir, args)
    text = heldout_text(work, tok, cfg)
    sub = work / f"qat4_p{args.steps}_s{args.qat_steps}_lr{args.lr:g}"
    sub.mkdir(exist_ok=True)
    rows: dict[str, dict] = {}

    ptq = work / f"qat4_p{args.steps}_ptq"  # float / PTQ rows, shared by runs with other QAT settings
    ptq.mkdir(exist_ok=True)

    def row(name: str, path: Path) -> float:
        out = (ptq if path.parent == ptq or path == ckpt else sub) / f"{name.replace(' ', '_')}_eval.json"
        m = json.loads(out.read_text())["metrics"] if out.is_file() else score(path, text, out, args.seq)
        rows[name] = {"bits_per_byte": m["bits_per_byte"], "ppl": m["ppl"], "path": str(path)}
        print(f"{name:34} bpb {m['bits_per_byte']:.4f}  ppl {m['ppl']:.3f}", flush=True)
        return m["bits_per_byte"]

    f = row("float", ckpt)
    ctrl = finetune(sub, tok, tok_dir, ckpt, args, "control_float_ft", [])
    c = row(f"float fine-tuned {args.qat_steps} steps (control)", ctrl)
    summary = {}
    for hb in args.head_bits:
        head = ["--head-bits", str(hb)]
        rtn = row(f"int4 g64 RTN, head {hb}", quantize(ckpt, ptq / f"int4_g64_RTN_head{hb}", [*INT4, *head], args))
        gptq = row(f"int4 g64 GPTQ, head {hb}", quantize(ckpt, ptq / f"int4_g64_GPTQ_head{hb}",
                                                         [*INT4, "--method", "gptq", *head], args))
        crtn = row(f"control int4 g64 RTN, head {hb}", quantize(ctrl, sub / f"control_RTN_head{hb}", [*INT4, *head],
                                                               args))
        qdir = finetune(sub, tok, tok_dir, ckpt, args, f"qat_int4_g64_head{hb}", qat_keys(hb))
        conv = quantize(qdir, sub / f"qat_int4_g64_head{hb}_int4", ["--weights", "int4"], args)
        q = row(f"QAT int4 g64, head {hb} (converted)", conv)
        gap = logits_gap(qdir, conv, tok, text)
        summary[hb] = {"rtn_inc": rtn - f, "gptq_inc": gptq - f, "qat_inc": q - f, "control_inc": c - f,
                       "control_rtn_inc": crtn - f, "recovery_vs_rtn": recovery(rtn - f, q - f),
                       "recovery_vs_gptq": recovery(gptq - f, q - f),
                       "recovery_vs_control": recovery(crtn - c, q - c), "logits_gap": gap}
    print(f"\nmachine: {cpu_name()} ({cpu_flags()}), {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}; total {time.perf_counter() - t_start:.0f}s")
    print(f"QAT / control: {args.qat_steps} steps, batch {args.batch} x {args.seq}, lr {args.lr:g} cosine to "
          f"{args.lr / 10:g}, no warmup, weight decay 0")
    for hb, s in summary.items():
        print(f"head {hb}: increase over float RTN {s['rtn_inc']:+.4f}, GPTQ {s['gptq_inc']:+.4f}, QAT "
              f"{s['qat_inc']:+.4f} (control {s['control_inc']:+.4f}, control RTN {s['control_rtn_inc']:+.4f}); "
              f"QAT recovers {100 * s['recovery_vs_rtn']:.0f}% of RTN's, {100 * s['recovery_vs_gptq']:.0f}% of "
              f"GPTQ's, {100 * s['recovery_vs_control']:.0f}% against the control; fake-quant vs converted logits "
              f"max |diff| fp32 kernel {s['logits_gap']['fp32']:.2e}, auto {s['logits_gap']['auto']:.2e}")
    rec = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args),
           "heldout_chars": len(text.read_text()), "rows": rows, "summary": summary}
    (sub / "qat4_quality.json").write_text(json.dumps(rec, indent=2) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")


if __name__ == "__main__":
    main()
