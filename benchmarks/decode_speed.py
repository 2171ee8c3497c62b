"""Greedy decoding speed: gptforge vs `transformers` generate on the same weights, in one run.

Model: GPT-2 124M shape (`Model.preset=124M`, vocabulary 50257, random weights), imported
into `transformers.GPT2LMHeadModel` with identical weights. Prompt 128 tokens, 64 new tokens
(EOS suppressed on both sides so every run produces exactly 64), greedy, fp32, batch 1 and 8.
Both outputs must be identical.

Reported per batch size: end-to-end tokens/s of one `generate` call (prefill included), the
time to the first token (prefill) and the per-token time of the decode steps after it.
At batch 1 fp32 decoding streams every weight from memory once per token, so the fastest
possible step is weight bytes / memory bandwidth; the bandwidth is measured here with a
256 MB fp32 matrix-vector product (the same operation a decode step is made of), and the
fraction of that limit reached is printed.

    .venv/bin/python benchmarks/decode_speed.py [--repeats 3] [--new-tokens 64] [--prompt 128]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gemv_bandwidth(repeats: int = 15) -> float:
    """Bytes/s of a 256 MB fp32 matrix-vector product (best of `repeats`)."""
    W = torch.randn(16384, 4096)
    x = torch.randn(4096)
    torch.mv(W, x)
    best = min(_timed(lambda: torch.mv(W, x)) for _ in range(repeats))
    return W.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def build_pair(seed: int = 0, extra: tuple[str, ...] = ()):
    """(our 124M-shape model, the same weights in transformers, resolved config); `extra`:
    more `Model.*` overrides (smaller shapes for a quick check)."""
    import transformers

    from gptforge.config import load_config
    from gptforge.model import build_model, convert
    from gptforge.model_io import hf_state_dict

    torch.manual_seed(seed)
    cfg = load_config(overrides=["Model.preset=124M", "Model.vocab_size=50257", "Model.vocab_size_divisible_unit=1",
                                 "Model.hidden_dropout_prob=0", "Model.attention_probs_dropout_prob=0", *extra])
    ours = build_model(cfg.Model).eval()
    hf_cfg = convert.model_to_hf_config(cfg.Model, eos_token_id=50256)
    hf_cfg = {k: v for k, v in hf_cfg.items() if k not in ("architectures", "torch_dtype")}
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_cfg)).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(ours, cfg.Model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    x = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        diff = (hf(x).logits - ours(x).logits).abs().max().item()
    assert diff < 1e-3, f"HF import differs from our model (max logit diff {diff})"
    return ours, hf, cfg


def run_hf(hf, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, num_beams=1, pad_token_id=50256, eos_token_id=50256)
    return out[:, ids.shape[1]:]


def run_ours(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    from gptforge.config.schema import GenerationConfig
    from gptforge.generate import generate_ids

    cfg = GenerationConfig(decode_strategy="greedy_search", max_dec_len=new, min_dec_len=new)
    return generate_ids(model, ids.tolist(), cfg, eos_token_id=50256).tokens


def measure(fn, ids, new: int, repeats: int) -> tuple[float, float, float, torch.Tensor]:
    """Best of `repeats`: (seconds for `new` tokens, seconds for 1 token = prefill, seconds per
    decode step from back-to-back pairs of those two runs, tokens)."""
    fn(ids, 2)  # warm-up: allocator, oneDNN kernels, lazy imports
    full, first, step, out = [], [], [], None
    for _ in range(repeats):
        first.append(_timed(lambda: fn(ids, 1)))
        t = time.perf_counter()
        out = fn(ids, new)
        full.append(time.perf_counter() - t)
        step.append((full[-1] - first[-1]) / (new - 1))
    return min(full), min(first), min(step), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per case (the best is reported)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128, help="prompt length in tokens")
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args(argv)

    ours, hf, cfg = build_pair()
    n_params = sum(p.numel() for p in ours.parameters())
    # Read per decode step: every weight except the position table (one row of it is read).
    weight_bytes = (n_params - ours.wpe.weight.numel()) * 4
    bw = statistics.median(gemv_bandwidth() for _ in range(3))
    limit_tps = bw / weight_bytes
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}")
    print(f"model: GPT-2 124M shape, {n_params / 1e6:.1f} M parameters, {weight_bytes / 1e6:.0f} MB read per "
          f"decode step (fp32); prompt {args.prompt}, {args.new_tokens} new tokens, greedy")
    print(f"memory bandwidth (256 MB fp32 gemv): {bw / 1e9:.1f} GB/s -> batch-1 limit "
          f"{limit_tps:.1f} tokens/s ({1e3 / limit_tps:.1f} ms per token)\n")

    g = torch.Generator().manual_seed(1)
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        ids = torch.randint(0, 50256, (B, args.prompt), generator=g)
        t_ours, p_ours, step_ours, out_ours = measure(lambda x, n: run_ours(ours, x, n), ids, args.new_tokens,
                                                      args.repeats)
        t_hf, p_hf, step_hf, out_hf = measure(lambda x, n: run_hf(hf, x, n), ids, args.new_tokens, args.repeats)
        same = torch.equal(out_ours, out_hf)
        n = B * args.new_tokens
        rows.append((B, n / t_ours, n / t_hf, p_ours, p_hf, step_ours, step_hf, same))
        print(f"batch {B}: ours {n / t_ours:.1f} tok/s, transformers {n / t_hf:.1f} tok/s "
              f"-> {t_hf / t_ours:.2f}x; outputs identical: {same}", flush=True)

    print("\n| batch | ours tok/s | transformers tok/s | speed-up | prefill ms ours / HF | "
          "decode step ms ours / HF | outputs equal |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for B, a, b, pa, pb, sa, sb, same in rows:
        print(f"| {B} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {pa * 1e3:.0f} / {pb * 1e3:.0f} | "
              f"{sa * 1e3:.1f} / {sb * 1e3:.1f} | {same} |")
    one = [r for r in rows if r[0] == 1]
    if one:
        _, a, b, _, _, sa, sb, _ = one[0]
        lim = 1.0 / limit_tps
        print(f"\nbatch 1 vs the weight-streaming limit ({limit_tps:.1f} tok/s, {lim * 1e3:.1f} ms/token):")
        print(f"  decode steps: ours {lim / sa:.0%} of the limit, transformers {lim / sb:.0%}")
        print(f"  end to end (prefill included): ours {a / limit_tps:.0%}, transformers {b / limit_tps:.0%}")
    # The 1-minute load average counts this benchmark's own threads too.
    load, own = os.getloadavg()[0], torch.get_num_threads()
    if load > own + 1.0:
        print(f"\nnote: load average {load:.2f} at the end with {own} threads of our own: other processes "
              "competed for the cores; rerun on a quiet machine for representative figures")
    ok = all(r[-1] for r in rows)
    if not ok:
        print("ERROR: outputs differ from transformers", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
