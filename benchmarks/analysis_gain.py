"""Does the sensitivity analysis pay? QAT of every layer vs QAT with the top-k layers left float.

The seed's table (PaddleSlim GPT-345M, LAMBADA): float 44.17, QAT 41.58, QAT after analysis
(top 7 of 96 layers float) 44.94. Here, in one run, on the built-in corpus:
  1. the small float GPT of benchmarks/qat_quality.py (same code and work directory, so a
     finished qat_quality run is reused): pretrained `--float-steps`, then the float control
     fine-tuned `--steps` more with frozen embeddings (what QAT trains);
  2. for each quantization setting (`--settings`, e.g. w4a8 = 4-bit weights, 8-bit activations,
     per-tensor abs_max, no PACT): QAT of all 16 Linears from the pretrained model for `--steps`;
  3. `gptforge analyze`'s code on that QAT model (qat mode, AnalysisQAT semantics: each layer's
     quantization off, its weight restored from the float model QAT started from), metric = mean
     loss on `--analysis-batches` Eval batches; k = the smallest number of layers that carry
     half of the positive sensitivity (`--k` to fix it);
  4. QAT again with the top-k skipped (the printed skip_tensor_map), and a control: QAT with the
     k *least* sensitive layers skipped (same number of float layers, chosen against the ranking);
  5. every model evaluated on `--report-batches` further Eval batches, disjoint from the
     analysis batches: ppl and next-token accuracy.
Goal (issue 7): the skip list recovers at least half of the gap QAT leaves to the float control.

    .venv/bin/python benchmarks/analysis_gain.py [--work runs/bench_qat] [--settings w4a8 w4a4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gptforge.config import load_config  # noqa: E402
from gptforge.model_io import (
    load_model,  # noqa: E402
    load_run_config,
)
from qat_quality import (  # noqa: E402
    cpu_name,
    finetune_overrides,
    overrides,
    quant_overrides,
    run_dir,
    setup_run,
)


def parse_setting(s: str) -> tuple[int, int, str]:
    """`w4a8` / `w4a4ch` → (weight bits, activation bits, weight type)."""
    ch = s.endswith("ch")
    body = s[:-2] if ch else s
    w, a = body[1:].split("a")
    return int(w), int(a), "channel_wise_abs_max" if ch else "abs_max"


def tag_of(setting: str) -> str:
    w, a, wtype = parse_setting(setting)
    # w4a8 per-tensor is qat_quality's `w4_t`: the same run, reused when present
    base = f"w{w}_{'ch' if wtype != 'abs_max' else 't'}"
    return base if a == 8 else f"{base}_a{a}"


def qat_run(args, tok, tok_dir, start: Path, setting: str, skip: dict | None, name: str) -> Path:
    from gptforge.compress.qat import qat

    w, a, wtype = parse_setting(setting)
    out = args.root / name
    if run_dir(out, args.steps) is None:
        shutil.rmtree(out, ignore_errors=True)
        q = quant_overrides(w, wtype, False, [f"Compress.Quantization.activation_bits={a}"])
        if skip:
            from gptforge.compress.sensitivity_report import flow_map

            q.append(f"Compress.Quantization.skip_tensor_map={flow_map(skip)}")
        cfg = load_config(overrides=[*overrides(tok_dir, args, out, args.steps, args.lr, args.lr / 10, 0.0),
                                     *finetune_overrides(args), *q, f"Compress.pretrained={start}"])
        t0 = time.perf_counter()
        qat(cfg, tok, progress=False, echo=False)
        print(f"{name}: QAT {args.steps} steps in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return run_dir(out, args.steps)


@torch.no_grad()
def report_metrics(model, batches) -> dict:
    """Token-weighted loss, ppl and next-token (argmax) accuracy."""
    model.eval()
    nll = correct = n = 0.0
    for b in batches:
        logits = model(b["tokens"], position_ids=b["position_ids"]).logits.float()
        lab = b["labels"]
        nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="sum"))
        correct += float((logits.argmax(-1) == lab).sum())
        n += lab.numel()
    return {"loss": nll / n, "ppl": math.exp(nll / n), "acc": 100.0 * correct / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench_qat")
    ap.add_argument("--float-steps", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=150, help="fine-tuning / QAT steps after pretraining")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--settings", nargs="+", default=["w4a8", "w4a4"])
    ap.add_argument("--analysis-batches", type=int, default=16)
    ap.add_argument("--report-batches", type=int, default=48)
    ap.add_argument("--k", type=int, help="layers to skip (default: the analysis' suggestion)")
    ap.add_argument("--quick", action="store_true", help="tiny run to check the script (numbers meaningless)")
    args = ap.parse_args()
    if args.quick:
        args.float_steps, args.steps, args.analysis_batches, args.report_batches = 20, 4, 2, 2
    from gptforge.compress.sensitivity_report import skip_tensor_map
    from gptforge.compress.sensitivity_run import run_analysis, split_batches

    t_start = time.perf_counter()
    tok, tok_dir, start, tuned = setup_run(args)
    fcfg = load_model(tuned)[1]
    n_a, n_r = args.analysis_batches, args.report_batches
    every = split_batches(fcfg, tok, "Eval", n_a + n_r)
    report = every[n_a:]  # the analysis reads the first n_a batches of the same split: disjoint
    float_m = report_metrics(load_model(tuned)[0], report)
    start_m = report_metrics(load_model(start)[0], report)
    results = []
    for setting in args.settings:
        tag = tag_of(setting)
        qat_all = qat_run(args, tok, tok_dir, start, setting, None, f"qat_{tag}")
        cfg = load_run_config(overrides=[f"Data.tokenizer={tok_dir}"], ckpt_dir=qat_all)
        t0 = time.perf_counter()
        an = run_analysis(cfg, qat_ckpt=qat_all, float_ckpt=start, metric="loss", batches=n_a,
                          out_dir=args.root / f"analysis_{tag}", tokenizer=tok, progress=False, echo=False)
        t_an = time.perf_counter() - t0
        ranked = an.analysis.ranked()
        assert torch.equal(split_batches(cfg, tok, "Eval", n_a)[0]["tokens"], every[0]["tokens"])
        k = args.k or max(1, an.suggested_k)
        top, bottom = ranked[:k], ranked[-k:]
        top_map, bottom_map = skip_tensor_map(r.name for r in top), skip_tensor_map(r.name for r in bottom)
        qat_top = qat_run(args, tok, tok_dir, start, setting, top_map, f"qat_{tag}_top{k}")
        qat_bottom = qat_run(args, tok, tok_dir, start, setting, bottom_map, f"qat_{tag}_bottom{k}")
        rows = {"qat_all": report_metrics(load_model(qat_all)[0], report),
                "qat_top": report_metrics(load_model(qat_top)[0], report),
                "qat_bottom": report_metrics(load_model(qat_bottom)[0], report)}
        gap = rows["qat_all"]["ppl"] - float_m["ppl"]
        rec = {key: (rows["qat_all"]["ppl"] - rows[key]["ppl"]) / gap if gap > 0 else None
               for key in ("qat_top", "qat_bottom")}
        results.append({"setting": setting, "k": k, "analysis_seconds": t_an, "analysis_evals": len(ranked) + 2,
                        "top": [(r.reference_name, r.name, r.sensitivity) for r in top],
                        "bottom": [(r.reference_name, r.name, r.sensitivity) for r in bottom],
                        "ranking": [(r.reference_name, r.name, r.sensitivity) for r in ranked],
                        "qat_base_loss": an.analysis.base_value, "float_start_loss": an.analysis.float_value,
                        "rows": rows, "recovered": rec, "top_map": top_map})
    total = time.perf_counter() - t_start

    print(f"\nmachine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}; total {total:.0f}s")
    print(f"model: hidden 128, 4 layers (16 quantized Linears), vocab 4096; float {args.float_steps} steps, then "
          f"{args.steps} steps of fine-tuning / QAT; analysis on {n_a} Eval batches, report on {n_r} other Eval "
          f"batches ({n_r * args.batch * args.seq} tokens)\n")
    print(f"float pretrained (QAT start): ppl {start_m['ppl']:.3f}, next-token acc {start_m['acc']:.2f}%\n")
    for r in results:
        print(f"### {r['setting']}: k = {r['k']} (analysis {r['analysis_seconds']:.0f}s, {r['analysis_evals']} "
              f"evaluations); top: {', '.join(f'{a} ({b}) {s:+.2e}' for a, b, s in r['top'])}")
        print("| model | strategy | ppl | next-token acc | gap to float recovered |")
        print("|---|---|---:|---:|---:|")
        print(f"| float | baseline (same {args.steps} steps, no quantization) | {float_m['ppl']:.3f} | {float_m['acc']:.2f}% | |")
        rows, rec = r["rows"], r["recovered"]
        print(f"| QAT {r['setting']} | all 16 Linears quantized (before analysis) | {rows['qat_all']['ppl']:.3f} "
              f"| {rows['qat_all']['acc']:.2f}% | |")
        for key, what in (("qat_top", f"top-{r['k']} sensitive layers float (after analysis)"),
                          ("qat_bottom", f"control: {r['k']} least sensitive layers float")):
            recs = f"{100 * rec[key]:.0f}%" if rec[key] is not None else "n/a"
            print(f"| QAT {r['setting']} | {what} | {rows[key]['ppl']:.3f} | {rows[key]['acc']:.2f}% | {recs} |")
        print()
    (args.root / "analysis_gain.json").write_text(json.dumps(
        {"float": float_m, "float_start": start_m, "results": results, "seconds": total,
         "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
