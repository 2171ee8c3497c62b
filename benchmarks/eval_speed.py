"""LAMBADA-format evaluation speed: gptforge vs lm-eval's HF backend, same model and data, one run.

A GPT-2-124M-shape model with random weights is exported to an HF directory; a LAMBADA-format
jsonl of a few hundred passages is generated (random GPT-2 words, ~40-110 per passage; every
other passage repeats its last word). The random token embeddings are scaled x10 so that the
model copies its last input token: the repeated words are then predicted and the accuracy is
about 50%, not trivially 0 (speed does not depend on the weights' values). Timed, each from a
loaded model to metrics:
  ours        gptforge.evaluate.evaluate_lambada at batch 8 (Offline_Eval.batch_size default) and 16
  lm-eval     HFLM(pretrained=<exported dir>) through simple_evaluate on a local task YAML
              (lambada_openai's template), at its default batch size (1) and at 16.
Per-example correctness must be identical across all three; the script exits 1 otherwise.

    .venv/bin/python benchmarks/eval_speed.py [--passages 200] [--preset 124M]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from gptforge.config import load_config  # noqa: E402
from gptforge.data.tokenizer import gpt2_tokenizer, gpt2_vocab_files  # noqa: E402
from gptforge.evaluate import evaluate_lambada  # noqa: E402
from gptforge.model import build_model  # noqa: E402
from gptforge.model_io import save_hf_dir  # noqa: E402

TASK_YAML = """task: lambada_bench
dataset_path: json
dataset_kwargs: {{data_files: {{test: {path}}}}}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - {{metric: perplexity, aggregation: perplexity, higher_is_better: false}}
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
"""


def make_passages(path: Path, n: int, seed: int = 0) -> float:
    """Write n LAMBADA-format passages; returns the mean passage length in words."""
    enc, _ = gpt2_vocab_files()
    words = sorted(w[1:] for w in json.loads(enc.read_text(encoding="utf-8"))
                   if w.startswith("\u0120") and w[1:].isalpha() and len(w) > 3)
    rng = random.Random(seed)
    total = 0
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            ws = [rng.choice(words) for _ in range(rng.randint(40, 110))]
            if i % 2 == 0:
                ws[-1] = ws[-2]
            total += len(ws)
            f.write(json.dumps({"text": " ".join(ws)}) + "\n")
    return total / n


def run_lm_eval(hf_dir: Path, task_dir: Path, batch_size: int):
    """(wall s, CPU s, per-example correctness, accuracy) for lm-eval's HFLM; model loading excluded."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(hf_dir), batch_size=batch_size, device="cpu")
    tm = TaskManager(include_path=str(task_dir), include_defaults=False)
    t0, c0 = time.perf_counter(), time.process_time()
    res = evaluator.simple_evaluate(model=lm, tasks=["lambada_bench"], task_manager=tm, log_samples=True,
                                    bootstrap_iters=0)
    dt, ct = time.perf_counter() - t0, time.process_time() - c0
    samples = sorted(res["samples"]["lambada_bench"], key=lambda s: s["doc_id"])
    return dt, ct, [bool(s["acc"]) for s in samples], res["results"]["lambada_bench"]["acc,none"]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001 - informational only
        return platform.processor() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passages", type=int, default=200)
    ap.add_argument("--preset", default="124M", help="model shape preset (random weights)")
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = load_config(overrides=[f"Model.preset={args.preset}", "Model.vocab_size=50304", "Model.hidden_dropout_prob=0",
                                 "Model.attention_probs_dropout_prob=0"])
    model = build_model(cfg.Model).eval()
    with torch.no_grad():
        model.wte.weight.mul_(10)  # see the module docstring: a copying model scores ~50%
    tok = gpt2_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        data = d / "lambada.jsonl"
        mean_words = make_passages(data, args.passages)
        save_hf_dir(model, cfg, d / "hf", tokenizer=tok)
        (d / "tasks").mkdir()
        (d / "tasks" / "lambada_bench.yaml").write_text(TASK_YAML.format(path=data))
        n_tok = sum(len(tok.encode(json.loads(line)["text"])) for line in data.read_text().splitlines())
        print(f"machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")
        print(f"model: preset {args.preset}, {model.num_parameters() / 1e6:.1f}M params (random init), fp32")
        print(f"data: {args.passages} passages, {mean_words:.1f} words / {n_tok / args.passages:.1f} tokens each")

        evaluate_lambada(model, tok, data, batch_size=8)  # warm-up (allocator, threads)
        rows, ours_ok = [], None
        for bs in (8, 16):
            t0, c0 = time.perf_counter(), time.process_time()
            ours = evaluate_lambada(model, tok, data, batch_size=bs)
            rows.append((f"gptforge evaluate_lambada{' (default)' if bs == 8 else ''}", bs,
                         time.perf_counter() - t0, time.process_time() - c0, ours["metrics"]["accuracy"]))
            ok = [e["correct"] for e in ours["examples"]]
            assert ours_ok is None or ok == ours_ok
            ours_ok = ok
        t_ours, c_ours = rows[0][2], rows[0][3]
        same = True
        for bs in (1, 16):
            dt, ct, ok, acc = run_lm_eval(d / "hf", d / "tasks", bs)
            rows.append(("lm-eval HFLM" + (" (default)" if bs == 1 else ""), bs, dt, ct, acc))
            same &= ok == ours_ok
    # CPU seconds of this process are reported too: on a shared machine they move much less
    # with other processes' load than wall time does.
    print("\n| runner | batch | wall s | CPU s | passages/s | accuracy | wall / ours@8 | CPU / ours@8 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, bs, dt, ct, acc in rows:
        print(f"| {name} | {bs} | {dt:.2f} | {ct:.2f} | {args.passages / dt:.2f} | {acc:.4f} | "
              f"{dt / t_ours:.2f}x | {ct / c_ours:.2f}x |")
    print(f"\nper-example correctness identical across runners: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
