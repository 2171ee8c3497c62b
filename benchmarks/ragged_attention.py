"""The attention part of one continuous-batching decode step, in one process: the engine's
per-sequence attention before this change (`generate/slots.py` at a git revision, one SDPA call
per sequence and layer on all threads) vs the current one vs the batched left-padded cache of the decoder before
the engine (`KVCache` + one SDPA per layer: fastest, but not batch-invariant). GPT-2 124M
attention shape (12 layers, 12 heads of 64), one new token per sequence; every variant runs
once per round, rounds interleaved; min and median of the rounds are printed. (Each ragged form is batch-invariant by construction: every sequence attends alone.)

    PYTHONPATH=src python benchmarks/ragged_attention.py [--rev 9191f5f] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gptforge.generate.slots import RaggedBatch, Segment, SeqSlot
from gptforge.model.gpt import CoreAttention, KVCache

LAYERS, HEADS, DIM = 12, 12, 64


def old_slots(rev: str):
    """`gptforge.generate.slots` as it was at git revision `rev`."""
    src = subprocess.run(["git", "show", f"{rev}:src/gptforge/generate/slots.py"], check=True, text=True,
                         capture_output=True, cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(tempfile.mkdtemp()) / "old_slots.py"
    path.write_text(src, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("old_slots", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_slots"] = mod
    spec.loader.exec_module(mod)
    return mod


def case(lengths: list[int], old, rounds: int) -> dict[str, list[float]]:
    layout = ([HEADS] * LAYERS, DIM, torch.float32, "cpu")
    cap = max(lengths) + 8
    alone = [SeqSlot(*layout[:1], cap, DIM, torch.float32, "cpu") for _ in lengths]
    for b, n in zip(alone, lengths, strict=True):
        for y in b.k + b.v:
            y.normal_()
        b.length = n
    q, k, v = (torch.randn(1, HEADS, len(lengths), DIM) for _ in range(3))
    core = CoreAttention(0.0).eval()
    cache = KVCache([HEADS] * LAYERS, len(lengths), cap, DIM)
    cache.length = max(lengths)
    qb, kb, vb = (x.transpose(0, 2).contiguous() for x in (q, k, v))

    def ragged(cls, slots):
        batch = cls([Segment(s, [1], s.length, True) for s in slots], "cpu")
        return [batch.attend(layer, q, k, v, core) for layer in range(LAYERS)]

    def padded():
        out = []
        for layer in range(LAYERS):
            keys, values = cache.update(layer, kb, vb)
            out.append(core(qb, keys, values, None, False))
        return out

    variants = {"engine before (per sequence, all threads)": lambda: ragged(old.RaggedBatch, alone),
                "now, separate slots": lambda: ragged(RaggedBatch, alone),
                "pre-engine padded batch": padded}
    times = {name: [] for name in variants}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, fn in variants.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="9191f5f", help="git revision of the per-sequence attention to compare")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    old = old_slots(args.rev)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for label, lengths in (("8 sequences, 160 positions each", [160] * 8),
                               ("8 sequences, 40..300 positions", [40, 77, 120, 160, 161, 200, 250, 300])):
            load = os.getloadavg()[0]
            times = case(lengths, old, args.rounds)
            base = statistics.median(times["engine before (per sequence, all threads)"])
            print(f"\n{threads} thread(s), {label}, 12 layers; load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
            for name, ts in times.items():
                med = statistics.median(ts)
                print(f"  {name:44s} min {min(ts) * 1e3:7.2f} ms  median {med * 1e3:7.2f} ms  "
                      f"median / engine-before {med / base:.2f}")


if __name__ == "__main__":
    main()
