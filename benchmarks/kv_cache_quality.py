"""KV cache dtypes (`Generation.kv_cache_dtype`): held-out perplexity with float32, bfloat16 and
int8 keys/values on the same text, one run (issue #32: bf16 within 0.1% of fp32; int8's drift
measured), and optionally decode tokens/s per dtype.

Quality. On the built-in corpus (`lowbit_quality.py`'s tokenizer, model shape and training
recipe: a GPT of hidden 128, 4 layers, trained from scratch for `--steps` steps on the Train
split), the Eval-split text no step trains on is cut into windows of `--seq` tokens. Every
window is run through `TorchBackend.step_all` with a KV cache of the dtype under test, in
chunks of `--chunk` tokens (32: generate's prefill chunks; 1: token by token, like decoding),
so every query attends over keys/values that were written to the cache and read back (int8:
quantized on write, dequantized on read). Perplexity is exp(mean NLL) over every token of every
window but the first; the same tokens for every dtype. The drift against float32 is also given
per token: mean KL(float32 || dtype) of the next-token distributions, mean and largest change of
a log-probability, and the share of positions whose most likely token changes.

Speed (`--speed`). GPT-2 124M shape: first one decode step's attention alone (every layer's
window read back from the cache, one query per row through SDPA) at context prompt + new
tokens; then (unless `--no-decode`) the whole model (random weights), a `--prompt`-token prompt
prefilled, `--new-tokens` greedy decode steps timed. Batch 1 and 8, the dtypes interleaved round
by round; medians and the ratio to float32; the load average is printed.

    .venv/bin/python benchmarks/kv_cache_quality.py [--work runs/bench_kv] [--steps 1000] [--speed]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from gptforge.generate.backend import TorchBackend  # noqa: E402
from gptforge.generate.memory import kv_bytes_per_position  # noqa: E402
from lowbit_quality import heldout_text, train  # noqa: E402  (benchmarks/ is on sys.path)
from qat_quality import cpu_name, tokenizer  # noqa: E402

DTYPES = ("float32", "bfloat16", "int8")


def windows(tok, text: Path, seq: int) -> torch.Tensor:
    ids = tok.encode(text.read_text(encoding="utf-8"))
    n = len(ids) // seq
    return torch.tensor(ids[: n * seq]).view(n, seq)


@torch.inference_mode()
def window_logprobs(be, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Log-probabilities [B, seq-1, V] of tokens 1.. of windows `ids` [B, seq], fed through a
    fresh cache of `be`'s KV dtype `chunk` tokens at a time."""
    seq = ids.shape[1]
    cache = be.new_cache(len(ids), seq)
    logits = []
    for s in range(0, seq, chunk):
        e = min(seq, s + chunk)
        logits.append(be.step_all(ids[:, s:e], torch.arange(s, e)[None].expand(len(ids), -1), None, cache))
    return torch.cat(logits, 1)[:, :-1].log_softmax(-1)


@torch.inference_mode()
def compare(model, wins: torch.Tensor, chunk: int, batch: int) -> dict:
    """Per KV dtype: perplexity, and against float32 on the same tokens: mean KL(fp32 || dtype)
    per token, mean |delta log p(token)|, the largest |delta log-prob| anywhere, the share of
    tokens whose argmax changes."""
    sums = {kv: dict(nll=0.0, kl=0.0, dlp=0.0, max=0.0, flips=0) for kv in DTYPES}
    count = 0
    backends = {kv: TorchBackend(model, kv_cache_dtype=kv).__enter__() for kv in DTYPES}
    try:
        for i in range(0, len(wins), batch):
            ids = wins[i:i + batch]
            target = ids[:, 1:, None]
            ref = window_logprobs(backends["float32"], ids, chunk)
            ref_tok = ref.gather(-1, target)
            count += target.numel()
            for kv, be in backends.items():
                lp = ref if kv == "float32" else window_logprobs(be, ids, chunk)
                tok_lp = lp.gather(-1, target)
                s = sums[kv]
                s["nll"] -= float(tok_lp.sum())
                s["kl"] += float((ref.exp() * (ref - lp)).sum())
                s["dlp"] += float((tok_lp - ref_tok).abs().sum())
                s["max"] = max(s["max"], float((lp - ref).abs().max()))
                s["flips"] += int((lp.argmax(-1) != ref.argmax(-1)).sum())
    finally:
        for be in backends.values():
            be.__exit__(None, None, None)
    return {kv: {"ppl": math.exp(s["nll"] / count), "kl_per_token": s["kl"] / count,
                 "mean_abs_dlogp": s["dlp"] / count, "max_abs_dlogp": s["max"], "argmax_changed": s["flips"] / count,
                 "tokens": count} for kv, s in sums.items()}


def quality(args) -> dict:
    from gptforge.model_io import load_model

    torch.manual_seed(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok, tok_dir = tokenizer(work)
    ckpt, cfg = train(work, tok, tok_dir, args)
    text = heldout_text(work, tok, cfg)
    model, _ = load_model(ckpt)
    model.eval()
    wins = windows(tok, text, args.seq)
    rows = {}
    for chunk in args.chunks:
        t0 = time.perf_counter()
        res = compare(model, wins, chunk, args.eval_batch)
        base = res["float32"]["ppl"]
        for kv, r in res.items():
            rows[f"{kv} chunk {chunk}"] = {"kv": kv, "chunk": chunk, **r}
            print(f"chunk {chunk:3d}  {kv:9s} ppl {r['ppl']:.5f}  ({(r['ppl'] / base - 1) * 100:+.5f}% vs float32)  "
                  f"KL {r['kl_per_token']:.3e}/token  mean|dlogp| {r['mean_abs_dlogp']:.3e}  "
                  f"max|dlogp| {r['max_abs_dlogp']:.3e}  argmax changed {r['argmax_changed'] * 100:.3f}%  "
                  f"({r['tokens']} tokens)", flush=True)
        print(f"chunk {chunk:3d}  {time.perf_counter() - t0:.0f}s", flush=True)
    heads = model.config.num_layers * model.config.num_attention_heads
    return {"model": str(ckpt), "heldout_chars": len(text.read_text()), "windows": list(wins.shape),
            "heads": heads, "head_dim": model.config.head_dim, "rows": rows}


@torch.inference_mode()
def decode_rate(be, cache_len: int, prompt: torch.Tensor, new: int) -> float:
    """Tokens/s of `new` greedy decode steps after prefilling `prompt` [B, P]."""
    B, P = prompt.shape
    cache = be.new_cache(B, cache_len)
    logits = be.step(prompt, torch.arange(P)[None].expand(B, -1), None, cache)
    t0 = time.perf_counter()
    for t in range(new):
        nxt = logits.argmax(-1, keepdim=True)
        logits = be.step(nxt, torch.full((B, 1), P + t), None, cache)
    return B * new / (time.perf_counter() - t0)


@torch.inference_mode()
def attention_ms(heads: int, layers: int, head_dim: int, batch: int, context: int, rounds: int) -> dict:
    """Median ms of one decode step's attention (read every layer's window back from the cache in
    float32, one query per row through SDPA), per KV dtype, interleaved round by round."""
    from gptforge.model.kv_cache import KV_DTYPES, KVCache

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, heads, context, head_dim, generator=g)
    q = torch.randn(batch, heads, 1, head_dim, generator=g)
    caches = {}
    for kv in DTYPES:
        c = KVCache([heads] * layers, batch, context, head_dim, dtype=KV_DTYPES[kv])
        for layer in range(layers):
            c.write(layer, 0, x, x)
        caches[kv] = c
    times: dict[str, list[float]] = {kv: [] for kv in DTYPES}
    for _ in range(rounds):
        for kv, c in caches.items():
            t0 = time.perf_counter()
            for layer in range(layers):
                k, v = c.read(layer, context, torch.float32)
                torch.nn.functional.scaled_dot_product_attention(q, k, v)
            times[kv].append((time.perf_counter() - t0) * 1e3)
    return {kv: statistics.median(t) for kv, t in times.items()}


def speed(args) -> dict:
    from gptforge.config import load_config
    from gptforge.model import build_model

    cfg = load_config(overrides=["Model.preset=124M", "Model.hidden_dropout_prob=0",
                                 "Model.attention_probs_dropout_prob=0"])
    torch.manual_seed(0)
    model = build_model(cfg.Model).eval()
    out = {}
    m = cfg.Model
    for batch in (1, 8):
        ctx = args.prompt + args.new_tokens
        ms = attention_ms(m.num_attention_heads, m.num_layers, m.head_dim, batch, ctx, max(5, args.rounds))
        out[f"attention batch {batch}"] = ms
        print(f"attention of one decode step, batch {batch}, context {ctx}: "
              + ", ".join(f"{kv} {t:.2f} ms (x{t / ms['float32']:.2f})" for kv, t in ms.items())
              + f"  load {os.getloadavg()[0]:.1f}", flush=True)
    if args.no_decode:
        return out
    for batch in (1, 8):
        prompt = torch.randint(0, 50000, (batch, args.prompt))
        rates: dict[str, list[float]] = {kv: [] for kv in DTYPES}
        loads = []
        for _ in range(args.rounds):
            for kv in DTYPES:  # interleaved: each round runs every dtype once
                with TorchBackend(model, kv_cache_dtype=kv) as be:
                    rates[kv].append(decode_rate(be, args.prompt + args.new_tokens, prompt, args.new_tokens))
            loads.append(os.getloadavg()[0])
        med = {kv: statistics.median(r) for kv, r in rates.items()}
        per_pos = {kv: kv_bytes_per_position(TorchBackend(model, kv_cache_dtype=kv)) for kv in DTYPES}
        out[f"batch {batch}"] = {"tok_s": rates, "median": med, "load_avg_1min": loads, "kv_bytes_per_token": per_pos}
        for kv in DTYPES:
            print(f"batch {batch}  {kv:9s} {med[kv]:7.1f} tok/s  x{med[kv] / med['float32']:.3f} vs float32  "
                  f"rounds {', '.join(f'{r:.1f}' for r in rates[kv])}  KV {per_pos[kv] / 1024:.1f} KiB/token",
                  flush=True)
        print(f"batch {batch}  load average (1 min) after each round: {', '.join(f'{x:.1f}' for x in loads)}",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench_kv")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16, help="training batch")
    ap.add_argument("--seq", type=int, default=128, help="training and evaluation window")
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 1], help="cache write chunks to evaluate")
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--speed", action="store_true", help="also time decoding of the 124M shape per dtype")
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--no-decode", action="store_true", help="--speed: only the attention timing")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the results (JSON) here too")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()}", file=sys.stderr)
    rec = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "argv": sys.argv[1:], "load_avg_start": os.getloadavg()}
    if not args.no_quality:
        rec["quality"] = quality(args)
    if args.speed:
        rec["speed"] = speed(args)
    rec["load_avg_end"] = os.getloadavg()
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")


if __name__ == "__main__":
    main()
