"""Before / after one change: the offline engine's batched greedy run (offline_batch.py's first 64
prompts at batch 64, the GPT-2 124M shape, random weights) with two checkouts, alternated, each
in its own process.

    .venv/bin/python benchmarks/engine_ab.py AFTER_ROOT BEFORE_ROOT [--pairs 3] [--threads 2] [--int8]

`--int8`: the same weights as a real INT8 model (`lowbit_decode.int8_model`: `ptq` + `--convert`,
int8 embedding / head) decoding with an int8 KV cache (the serving line of issue #32).

Per run: output tokens/s (wall), the process's CPU milliseconds per token (all threads: less
sensitive than wall time to other tenants of a shared host) and a hash of the generated ids (equal
hashes: both trees produced the same tokens). One run of this script as `--one ROOT` does one
measurement (what the alternation calls).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time


def one(root: str, threads: int, int8: bool = False) -> dict:
    sys.path[:0] = [os.path.join(root, "src"), os.path.join(root, "benchmarks")]
    import torch

    torch.set_num_threads(threads)
    from gptforge.config import load_config
    from gptforge.model import build_model
    from offline_batch import ours_batched, workload

    torch.manual_seed(0)
    cfg = load_config(overrides=["Model.preset=124M", "Model.vocab_size=50257", "Model.vocab_size_divisible_unit=1",
                                 "Model.hidden_dropout_prob=0", "Model.attention_probs_dropout_prob=0"])
    model = build_model(cfg.Model).eval()
    kv = "auto"
    if int8:
        from lowbit_decode import int8_model

        model, kv = int8_model(model, 50257), "int8"
    work = workload(64)
    ours_batched(model, work[:4], 64, kv)  # warm: packing, kernels
    t, c = time.perf_counter(), time.process_time()
    out = ours_batched(model, work, 64, kv)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    toks = sum(len(o) for o in out)
    return {"tok_s": toks / dt, "cpu_ms_per_tok": dc / toks * 1e3, "tokens": toks,
            "hash": hashlib.sha1(str(out).encode()).hexdigest()[:12]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("after", nargs="?")
    ap.add_argument("before", nargs="?")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8", action="store_true", help="the real INT8 model with an int8 KV cache")
    ap.add_argument("--one", metavar="ROOT", help="one measurement with this checkout (JSON on stdout)")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.threads, args.int8)))
        return 0
    if not (args.after and args.before):
        ap.error("give AFTER_ROOT and BEFORE_ROOT")
    runs: dict[str, list[dict]] = {"after": [], "before": []}
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for _ in range(args.pairs):
        for name, root in (("after", args.after), ("before", args.before)):
            res = subprocess.run([sys.executable, __file__, "--one", root, "--threads", str(args.threads),
                                  *(["--int8"] if args.int8 else [])],
                                 capture_output=True, text=True, check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            runs[name].append(r)
            print(f"{name:6s} {r['tok_s']:7.1f} tok/s  {r['cpu_ms_per_tok']:6.2f} CPU ms/token  ids {r['hash']}", flush=True)
    a, b = runs["after"], runs["before"]
    ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(a, b, strict=True)]
    print(f"after / before tok/s per pair: {', '.join(f'{v:.2f}' for v in ratios)} (median "
          f"{statistics.median(ratios):.2f}); CPU ms/token medians {statistics.median(x['cpu_ms_per_tok'] for x in a):.2f}"
          f" vs {statistics.median(x['cpu_ms_per_tok'] for x in b):.2f}; same tokens: "
          f"{len({x['hash'] for x in a + b}) == 1}; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
