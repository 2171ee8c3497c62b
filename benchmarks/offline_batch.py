"""Offline batch generation: many prompts of mixed lengths through `generate` (the engine's
continuous batching run to completion) vs the same prompts one at a time, and vs `transformers`
`generate` at its best static batch size (left-padded batches), on the same weights in one run.

Model: GPT-2 124M shape (`Model.preset=124M`, vocabulary 50257, random weights), imported into
`transformers.GPT2LMHeadModel` with identical weights (`decode_speed.build_pair`). Prompts: a
fixed seed draws lengths of 8..96 tokens and 16..64 new tokens per prompt (EOS suppressed, greedy,
fp32). Every output is checked against the one-at-a-time output (same greedy tokens). Goals
(issue #30): >= 3x one at a time, >= 1.5x transformers at its best batch size.

    .venv/bin/python benchmarks/offline_batch.py [--prompts 256] [--hf-batches 8,16,32,64] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import build_pair, cpu_name  # noqa: E402

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) per prompt: mixed lengths from a fixed seed."""
    rng = random.Random(seed)
    return [([rng.randrange(50256) for _ in range(rng.randint(8, 96))], rng.randint(16, 64)) for _ in range(n)]


def ours_batched(model, work, batch: int, kv_cache_dtype: str = "auto") -> list[list[int]]:
    """The engine: every prompt submitted at once, up to `batch` decoding together (each with
    its own max_tokens, so the requests are those of one call per length; one engine)."""
    from gptforge.generate.backend import TorchBackend
    from gptforge.generate.engine import Request, SamplingParams
    from gptforge.generate.engine.offline import offline_engine

    with TorchBackend(model, kv_cache_dtype=kv_cache_dtype) as be:
        core = offline_engine(be, eos_token_ids=[], vocab_limit=None, max_batch_size=batch)
        seqs = [core.add(Request([p], SamplingParams(max_tokens=n, temperature=0)), bounded=False)[0]
                for p, n in work]
        with torch.inference_mode():
            while core.has_work:
                core.step()
    return [s.generated for s in seqs]


def ours_one_by_one(model, work) -> list[list[int]]:
    from gptforge.config.schema import GenerationConfig
    from gptforge.generate import generate_ids

    out = []
    for p, n in work:
        cfg = GenerationConfig(decode_strategy="greedy_search", max_dec_len=n, min_dec_len=n)
        out.append(generate_ids(model, [p], cfg, eos_token_id=50256).sequences()[0])
    return out


def hf_static(hf, work, batch: int) -> list[list[int]]:
    """transformers generate in left-padded static batches of `batch` (prompts sorted by length,
    as a user would; each batch runs to its longest max_new_tokens, outputs cut to each row's)."""
    order = sorted(range(len(work)), key=lambda i: len(work[i][0]))
    out: list[list[int] | None] = [None] * len(work)
    for b in range(0, len(order), batch):
        idx = order[b:b + batch]
        L = max(len(work[i][0]) for i in idx)
        new = max(work[i][1] for i in idx)
        ids = torch.full((len(idx), L), 50256, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            p = work[i][0]
            ids[r, L - len(p):] = torch.tensor(p)
            mask[r, L - len(p):] = 1
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              num_beams=1, pad_token_id=50256, eos_token_id=50256)[:, L:]
        for r, i in enumerate(idx):
            out[i] = gen[r, : work[i][1]].tolist()
    return out  # type: ignore[return-value]


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="ours: sequences decoding together (default 64)")
    ap.add_argument("--hf-batches", default="8,16,32,64")
    ap.add_argument("--one-by-one", type=int, default=0,
                    help="time one-at-a-time on the first N prompts only and scale (default: all)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                    help="a Model.* override of the 124M shape for a quick check (e.g. Model.num_layers=2)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ours, hf, _ = build_pair(extra=tuple(args.model))
    work = workload(args.prompts)
    total = sum(n for _, n in work)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"command: python benchmarks/offline_batch.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"workload: {len(work)} prompts of {min(len(p) for p, _ in work)}..{max(len(p) for p, _ in work)} tokens, "
          f"{total} new tokens in all (greedy, EOS suppressed)\n")
    ours_batched(ours, work[:4], args.batch)  # warm-up
    t_b, out_b = timed(lambda: ours_batched(ours, work, args.batch))
    k = args.one_by_one or len(work)
    t_1, out_1 = timed(lambda: ours_one_by_one(ours, work[:k]))
    t_1_all = t_1 * total / sum(n for _, n in work[:k])
    same = out_b[:k] == out_1
    rows = [("gptforge generate (engine, continuous batching)", t_b, total / t_b, same),
            (f"gptforge one prompt at a time{'' if k == len(work) else f' ({k} prompts, scaled)'}", t_1_all,
             total / t_1_all, True)]
    best = None
    for B in (int(x) for x in args.hf_batches.split(",")):
        t_h, out_h = timed(lambda B=B: hf_static(hf, work, B))
        rows.append((f"transformers generate, static batch {B}", t_h, total / t_h, out_h == out_b))
        best = max(best or 0.0, total / t_h)
    print("| run | seconds | tokens/s | output = ours |\n|---|---:|---:|:---:|")
    for name, t, tps, ok in rows:
        print(f"| {name} | {t:.1f} | {tps:.1f} | {ok} |")
    print(f"\n- continuous batching vs one at a time: {rows[0][2] / rows[1][2]:.2f}x (goal >= 3x)")
    print(f"- vs transformers at its best static batch: {rows[0][2] / best:.2f}x (goal >= 1.5x)")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
