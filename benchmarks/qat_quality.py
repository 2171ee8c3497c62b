"""QAT vs PTQ vs float on the built-in corpus, INT8 and INT4 weights, with and without PACT.

On the built-in corpus (this Python's standard library, byte-level BPE of 4096 tokens learned
from it), in one run:
  1. pretrain a small float GPT with the trainer (`--float-steps`);
  2. give every model the same further data budget (`--steps` more steps from that point):
     - float: plain fine-tuning of what QAT trains (embeddings frozen, as the reference's QAT);
     - PTQ: the fine-tuned float model, activation scales calibrated on 8 Train batches
       (`gptforge ptq`'s code), no training;
     - QAT: `gptforge qat`'s code from the pretrained float model for the same steps;
     for weight_quantize_type abs_max and channel_wise_abs_max, activation
     moving_average_abs_max, with and without PACT (the reference's init 100 and lr x1000),
     weight_bits 8 and 4 (activations 8 bits), freeze_embedding as the reference;
  3. evaluate every model on the same held-out batches (Eval split): loss and ppl;
  4. convert the INT8 QAT models to real INT8 models (`gptforge quantize --convert`'s code) with
     the embedding as trained (float) and forced int8, plus a QAT run that trains with the
     embedding quantized; evaluate them and compare their logits with the fake-quant model on an
     eval batch, next to the fake-quant model's own fp32-vs-fp64 rounding floor.
Goals (issue 6): INT8 QAT within 2% of float ppl; at 4 bits QAT recovers at least half of
PTQ's ppl loss; converted vs fake-quant logits SQNR >= 35 dB and argmax agreement >= 99%.

    .venv/bin/python benchmarks/qat_quality.py [--work runs/bench_qat] [--float-steps 1000] [--steps 150]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from gptforge.config import load_config  # noqa: E402
from gptforge.model_io import load_model  # noqa: E402

SHAPE = ["Model.hidden_size=128", "Model.num_layers=4", "Model.num_attention_heads=4", "Model.ffn_hidden_size=512",
         "Model.vocab_size=4096", "Model.max_position_embeddings=256", "Model.hidden_dropout_prob=0",
         "Model.attention_probs_dropout_prob=0"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return "unknown"


def tokenizer(work: Path, vocab_size: int = 4096):
    from gptforge.data.corpus import builtin_documents
    from gptforge.data.tokenizer import load_tokenizer, train_tokenizer

    tok_dir = work / ("tokenizer" if vocab_size == 4096 else f"tokenizer_{vocab_size}")
    if not (tok_dir / "tokenizer.json").is_file():
        t0 = time.perf_counter()
        train_tokenizer(builtin_documents(), vocab_size=vocab_size, show_progress=False).save(tok_dir)
        print(f"tokenizer: learned in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return load_tokenizer(str(tok_dir)), tok_dir


def overrides(tok_dir: Path, args, out: Path, steps: int, lr: float, min_lr: float, warmup: float) -> list[str]:
    return [*SHAPE, f"Global.device={getattr(args, 'device', 'cpu')}", f"Global.global_batch_size={args.batch}",
            f"Global.micro_batch_size={args.batch}", "Engine.mix_precision.enable=False", "Engine.eval_freq=0",
            "Engine.logging_freq=50", "Engine.save_load.save_steps=-1", f"Engine.save_load.output_dir={out}",
            f"Engine.max_steps={steps}", f"Optimizer.lr.max_lr={lr}", f"Optimizer.lr.min_lr={min_lr}",
            f"Optimizer.lr.warmup_rate={warmup}", f"Optimizer.lr.decay_steps={steps}", f"Data.tokenizer={tok_dir}",
            *(f"Data.{s}.dataset.{k}" for s in ("Train", "Eval") for k in ("input_dir=builtin", f"max_seq_len={args.seq}")),
            "Data.Train.loader.num_workers=0", "Data.Eval.loader.num_workers=0"]


def finetune_overrides(args) -> list[str]:
    # The reference's QAT recipe: weight decay 0.02, dropout 0, a small lr with a cosine to min_lr.
    return ["Optimizer.weight_decay=0.02"]


def run_dir(path: Path, steps: int) -> Path | None:
    from gptforge.train import checkpoint as ckpt

    last = ckpt.latest_checkpoint(path)
    return last if last is not None and ckpt.read_meta(last)["step"] == steps else None


def _freeze_embeddings(model):
    model.wte.weight.requires_grad_(False)
    model.wpe.weight.requires_grad_(False)
    return model


def train_float(work, tok, tok_dir, args) -> tuple[Path, Path]:
    """(pretrained float checkpoint, the same fine-tuned for --steps with frozen embeddings)."""
    from gptforge.train import pretrain

    base = work / f"float_{args.float_steps}"
    if run_dir(base, args.float_steps) is None:
        shutil.rmtree(base, ignore_errors=True)
        cfg = load_config(overrides=overrides(tok_dir, args, base, args.float_steps, 2e-3, 2e-4, 0.02))
        t0 = time.perf_counter()
        pretrain(cfg, tokenizer=tok, progress=False, echo=False)
        print(f"float: {args.float_steps} steps in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    start = run_dir(base, args.float_steps)
    tuned = args.root / "float_ft"
    if run_dir(tuned, args.steps) is None:
        shutil.rmtree(tuned, ignore_errors=True)
        cfg = load_config(overrides=[*overrides(tok_dir, args, tuned, args.steps, args.lr, args.lr / 10, 0.0),
                                     *finetune_overrides(args), f"Compress.pretrained={start}"])
        # the same trainable set as QAT (freeze_embedding), so that only quantization differs
        pretrain(cfg, tokenizer=tok, transform=_freeze_embeddings, progress=False, echo=False)
    return start, run_dir(tuned, args.steps)


def setup_run(args) -> tuple:
    """(tokenizer, its dir, pretrained float checkpoint, fine-tuned float checkpoint) for the run
    directory `args.root` under `--work` (named by the float/fine-tune settings; shared with
    analysis_gain.py, so either benchmark reuses what the other trained)."""
    torch.manual_seed(0)
    work = Path(args.work)
    args.root = work / f"p{args.float_steps}_s{args.steps}_lr{args.lr:g}_{args.batch}x{args.seq}"
    args.root.mkdir(parents=True, exist_ok=True)
    tok, tok_dir = tokenizer(work)
    start, tuned = train_float(work, tok, tok_dir, args)
    return tok, tok_dir, start, tuned


def quant_overrides(bits: int, wtype: str, pact: bool, extra=()) -> list[str]:
    return ["Compress.Quantization.enable=True", f"Compress.Quantization.weight_bits={bits}",
            f"Compress.Quantization.weight_quantize_type={wtype}",
            "Compress.Quantization.activation_quantize_type=moving_average_abs_max",
            f"Compress.Quantization.activation_preprocess_type={'PACT' if pact else ''}",
            "Compress.Quantization.freeze_embedding=True", *extra]


def eval_batches(cfg, tok, n: int) -> list[dict]:
    from gptforge.data.dataset import build_datasets, collate

    mbs = cfg.Global.micro_batch_size
    ds = build_datasets(cfg, ("Eval",), num_samples={"Eval": n * mbs}, tokenizer=tok)["Eval"]
    return [collate([ds[k * mbs + j] for j in range(mbs)]) for k in range(n)]


@torch.no_grad()
def eval_loss(model, batches) -> float:
    model.eval()
    return sum(float(model(b["tokens"], position_ids=b["position_ids"], labels=b["labels"]).loss)
               for b in batches) / len(batches)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench_qat")
    ap.add_argument("--float-steps", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=150, help="further steps for float fine-tuning and QAT")
    ap.add_argument("--lr", type=float, default=2e-4, help="max lr of fine-tuning and QAT (cosine to lr/10)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--quick", action="store_true", help="tiny run to check the script (numbers meaningless)")
    args = ap.parse_args()
    if args.quick:
        args.float_steps, args.steps, args.eval_batches = 20, 4, 2
    from gptforge.compress.int8_convert import compare_logits, convert_checkpoint
    from gptforge.compress.ptq import ptq
    from gptforge.compress.qat import qat

    t_start = time.perf_counter()
    tok, tok_dir, start, tuned = setup_run(args)
    float_model, fcfg = load_model(tuned)
    batches = eval_batches(fcfg, tok, args.eval_batches)
    float_loss = eval_loss(float_model, batches)
    start_loss = eval_loss(load_model(start)[0], batches)
    rows, convs = [], []
    for bits in args.bits:
        for wtype in ("abs_max", "channel_wise_abs_max"):
            for pact in (False, True):
                tag = f"w{bits}_{'ch' if wtype != 'abs_max' else 't'}{'_pact' if pact else ''}"
                q = quant_overrides(bits, wtype, pact)
                cfg = load_config(overrides=[*overrides(tok_dir, args, args.root / tag, args.steps, args.lr,
                                                        args.lr / 10, 0.0), *q])
                pdir = args.root / f"ptq_{tag}"
                ptq(cfg, pdir, source=tuned, tokenizer=tok, overwrite=True, progress=False, echo=False)
                ptq_loss = eval_loss(load_model(pdir)[0], batches)
                qdir = args.root / f"qat_{tag}"
                if run_dir(qdir, args.steps) is None:
                    shutil.rmtree(qdir, ignore_errors=True)
                    cfg = load_config(overrides=[*overrides(tok_dir, args, qdir, args.steps, args.lr, args.lr / 10, 0.0),
                                                 *finetune_overrides(args), *q, f"Compress.pretrained={start}"])
                    t0 = time.perf_counter()
                    qat(cfg, tok, progress=False, echo=False)
                    print(f"{tag}: QAT {args.steps} steps in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
                qat_dir = run_dir(qdir, args.steps)
                qat_model = load_model(qat_dir)[0]
                qat_loss = eval_loss(qat_model, batches)
                alphas = [float(m.pact_alpha) for m in qat_model.modules() if getattr(m, "pact_alpha", None) is not None]
                row = {"bits": bits, "weight": wtype, "pact": pact, "float_loss": float_loss, "ptq_loss": ptq_loss,
                       "qat_loss": qat_loss, "alpha_min": min(alphas) if alphas else None,
                       "alpha_max": max(alphas) if alphas else None}
                if bits == 8:
                    for emb in (None, True):  # as trained (float embedding), and forced int8
                        out = args.root / f"int8_{tag}{'_emb' if emb else ''}"
                        r = convert_checkpoint(qat_dir, out, int8_embedding=emb, overwrite=True, echo=False)
                        i8 = load_model(out)[0]
                        ids = batches[0]["tokens"]
                        stats = compare_logits(qat_model, i8, ids)
                        convs.append({"model": tag, "int8_embedding": bool(emb), "int8_loss": eval_loss(i8, batches),
                                      "qat_loss": qat_loss, "bytes_ratio": r.int8_bytes / r.fake_quant_bytes, **stats})
                rows.append(row)
    # the same QAT with the embedding fake-quantized (so the INT8 embedding is part of training)
    if 8 in args.bits:
        tag = "w8_ch_pact_qemb"
        qdir = args.root / f"qat_{tag}"
        q = quant_overrides(8, "channel_wise_abs_max", True, ["Compress.Quantization.quantize_embedding=True"])
        if run_dir(qdir, args.steps) is None:
            shutil.rmtree(qdir, ignore_errors=True)
            cfg = load_config(overrides=[*overrides(tok_dir, args, qdir, args.steps, args.lr, args.lr / 10, 0.0),
                                         *finetune_overrides(args), *q, f"Compress.pretrained={start}"])
            qat(cfg, tok, progress=False, echo=False)
        qat_model = load_model(run_dir(qdir, args.steps))[0]
        out = args.root / f"int8_{tag}"
        r = convert_checkpoint(run_dir(qdir, args.steps), out, overwrite=True, echo=False)
        i8 = load_model(out)[0]
        stats = compare_logits(qat_model, i8, batches[0]["tokens"])
        convs.append({"model": tag, "int8_embedding": True, "int8_loss": eval_loss(i8, batches),
                      "qat_loss": eval_loss(qat_model, batches), "bytes_ratio": r.int8_bytes / r.fake_quant_bytes,
                      **stats})
    # the fake-quant model's own rounding floor: fp32 vs fp64 evaluation of the same model
    fq = load_model(run_dir(args.root / "qat_w8_ch_pact", args.steps))[0] if 8 in args.bits else None
    floor = None
    if fq is not None:
        floor = compare_logits(copy.deepcopy(fq).double(), fq, batches[0]["tokens"])
    total = time.perf_counter() - t_start

    print(f"\nmachine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}; total {total:.0f}s")
    print(f"model: hidden 128, 4 layers, 4 heads, FFN 512, vocab 4096; float {args.float_steps} steps, then "
          f"{args.steps} steps of fine-tuning / QAT (batch {args.batch} x {args.seq}, lr {args.lr:g} cosine to "
          f"{args.lr / 10:g}); eval {args.eval_batches} batches of the Eval split\n")
    fppl = math.exp(float_loss)
    print(f"float ppl after {args.float_steps} steps: {math.exp(start_loss):.3f}; after {args.steps} more (embeddings "
          f"frozen, as QAT): {fppl:.3f}\n")
    print("| weights | weight type | PACT (alpha after QAT) | float ppl | PTQ ppl | QAT ppl | PTQ vs float "
          "| QAT vs float | QAT recovers of PTQ's loss |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        pp, qp = math.exp(r["ptq_loss"]), math.exp(r["qat_loss"])
        rec = (pp - qp) / (pp - fppl) if pp > fppl else None
        r.update(float_ppl=fppl, ptq_ppl=pp, qat_ppl=qp, recovered=rec)
        pact = f"yes ({r['alpha_min']:.4g}..{r['alpha_max']:.4g})" if r["pact"] else "no"
        recs = f"{100 * rec:.0f}%" if rec is not None else "n/a (PTQ lossless)"
        print(f"| int{r['bits']} | {r['weight']} | {pact} | {fppl:.3f} | {pp:.3f} | {qp:.3f} "
              f"| {100 * (pp / fppl - 1):+.2f}% | {100 * (qp / fppl - 1):+.2f}% | {recs} |")
    if convs:
        print("\n| QAT model | INT8 embedding | fake-quant ppl | INT8 ppl | logits SQNR | argmax agreement | "
              "bytes vs fake-quant |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for c in convs:
            print(f"| {c['model']} | {'yes' if c['int8_embedding'] else 'no'} | {math.exp(c['qat_loss']):.3f} | "
                  f"{math.exp(c['int8_loss']):.3f} | {c['sqnr_db']:.1f} dB | {100 * c['argmax_agreement']:.2f}% | "
                  f"{c['bytes_ratio']:.1%} |")
    if floor is not None:
        print(f"\nrounding floor: the fake-quant model (w8_ch_pact) in fp32 vs fp64: SQNR {floor['sqnr_db']:.1f} dB, "
              f"argmax agreement {100 * floor['argmax_agreement']:.2f}%")
    (args.root / "qat_quality.json").write_text(json.dumps({"rows": rows, "conversions": convs, "floor": floor,
                                                       "args": {k: str(v) for k, v in vars(args).items()}, "seconds": total}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
