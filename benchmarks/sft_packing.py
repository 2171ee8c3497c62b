"""Packing on vs off for instruction tuning: real (non-padding) tokens trained per second.

The synthetic instruction set (data/synthetic_instructions.py) rendered with the default chat
template and GPT-2's BPE, in rows of `--seq` tokens: packed (several examples per row,
block-diagonal attention) and padded (one example per row). Both train the same tiny-CPU-shape
GPT (hidden 128, 4 layers) with AdamW, in interleaved rounds (packed step, padded step, ...) so
machine load hits both alike; reported: medians of step time, real tokens per step and real
tokens/s, their ratio, and the load average.

    .venv/bin/python benchmarks/sft_packing.py [--rounds 20] [--batch 16] [--seq 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from gptforge.config import load_config  # noqa: E402
from gptforge.data.chat_template import ChatTemplate  # noqa: E402
from gptforge.data.packing import build_rows, packed_attention_mask  # noqa: E402
from gptforge.data.synthetic_instructions import make_instances, messages  # noqa: E402
from gptforge.data.tokenizer import gpt2_tokenizer  # noqa: E402
from gptforge.model import build_model  # noqa: E402


def step(model, opt, rows, i: int, batch: int, packed: bool) -> tuple[float, int]:
    sl = slice(i * batch, (i + 1) * batch)
    b = {k: torch.as_tensor(getattr(rows, k)[sl]) for k in ("tokens", "labels", "loss_mask", "position_ids", "segments")}
    t0 = time.perf_counter()
    mask = packed_attention_mask(b["segments"]) if packed else None
    loss = model(b["tokens"], position_ids=b["position_ids"], attention_mask=mask, labels=b["labels"],
                 loss_mask=b["loss_mask"]).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, int((b["segments"] > 0).sum())


def instruction_rows(seq: int, n: int = 4000) -> dict:
    """{packed: rows} of `n` synthetic instruction examples (default template, GPT-2 BPE) in
    rows of `seq` tokens, packed (True) and one example per row (False)."""
    tok = gpt2_tokenizer()
    template = ChatTemplate()
    train, _ = make_instances(n, 0)
    ex = [template.encode(tok, messages(p, a)) for p, a, _ in train]
    return {True: build_rows(ex, seq, True), False: build_rows(ex, seq, False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = instruction_rows(args.seq)
    need = args.rounds * args.batch
    if min(len(r) for r in rows.values()) < need:
        raise SystemExit(f"not enough rows for {args.rounds} rounds of {args.batch}")
    cfg = load_config(overrides=["Model.hidden_size=128", "Model.num_layers=4", "Model.num_attention_heads=4",
                                 "Model.ffn_hidden_size=512", "Model.max_position_embeddings=256",
                                 "Model.hidden_dropout_prob=0", "Model.attention_probs_dropout_prob=0"])
    times: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    models = {}
    for packed in (True, False):
        torch.manual_seed(0)
        m = build_model(cfg.Model).train()
        models[packed] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4))
        step(*models[packed], rows[packed], 0, args.batch, packed)  # warm-up
    for i in range(1, args.rounds):
        for packed in (True, False):
            times[packed].append(step(*models[packed], rows[packed], i, args.batch, packed))
    print(f"load average {os.getloadavg()[0]:.1f} / {os.cpu_count()} cores, {args.threads} threads, batch "
          f"{args.batch} x {args.seq}, {rows[True].examples} examples: packed {len(rows[True])} rows "
          f"({rows[True].fill:.0%} real tokens), padded {len(rows[False])} rows ({rows[False].fill:.0%})")
    tps = {}
    for packed, name in ((True, "packed"), (False, "padded")):
        t = statistics.median(x for x, _ in times[packed])
        n = statistics.median(n for _, n in times[packed])
        tps[packed] = statistics.median(n / x for x, n in times[packed])
        print(f"{name}: step {t * 1000:.0f} ms, real tokens/step {n:.0f}, real tokens/s {tps[packed]:.0f}")
    print(f"packing gain: {tps[True] / tps[False]:.2f}x real tokens/s")


if __name__ == "__main__":
    main()
