"""Training throughput: gptforge's trainer step vs `transformers.GPT2LMHeadModel`, same run.

Shape S by default (vocab 50304, hidden 384, 6 layers, 6 heads, seq 256, batch 8), fp32,
dropout 0.1 in both, the same AdamW (gptforge's param groups, torch's fused kernel) and the
same global-norm clipping. Ours runs `Trainer.train_step` (the real loop body: micro-batch
loop, loss, clip, step, LR); the peer runs the equivalent plain PyTorch step. Steps alternate
in rounds (ours/peer, then peer/ours) so that load from other processes hits both alike; the
median step time of each is reported with tokens/s, their ratio, and model-FLOPs utilisation
against a measured fp32 sgemm ceiling.

    .venv/bin/python benchmarks/train_throughput.py                # shape S, 6 rounds
    .venv/bin/python benchmarks/train_throughput.py --profile      # + top ops of each step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def sgemm_ceiling(n: int = 2048, reps: int = 3) -> float:
    """Best-of fp32 matmul FLOP/s on this machine (the compute ceiling)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    from gptforge.config import load_config
    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.train import Trainer
    from gptforge.train.optim import build_optimizer

    out = tempfile.mkdtemp(prefix="gf-bench-")
    cfg = load_config(overrides=[
        "Model.preset=small", f"Model.hidden_size={args.hidden}", f"Model.num_layers={args.layers}",
        f"Model.num_attention_heads={args.heads}", f"Model.ffn_hidden_size={4 * args.hidden}",
        "Model.hidden_dropout_prob=0.1", "Model.attention_probs_dropout_prob=0.1", "Global.device=cpu",
        f"Global.global_batch_size={args.batch}", f"Global.micro_batch_size={args.batch}",
        f"Data.Train.dataset.max_seq_len={args.seq}", "Engine.mix_precision.enable=False",
        f"Engine.save_load.output_dir={out}", "Optimizer.lr.warmup_rate=0", "Optimizer.name=FusedAdamW"])
    torch.manual_seed(0)
    # Both models step on one fixed synthetic batch (below); no corpus is read.
    trainer = Trainer(cfg, tokenizer=gpt2_tokenizer(), datasets={"Train": [None]}, progress=False, echo=False)
    hf_cfg = GPT2Config(vocab_size=cfg.Model.vocab_size, n_positions=cfg.Model.max_position_embeddings,
                        n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1)
    hf = GPT2LMHeadModel(hf_cfg).train()
    hf_opt = build_optimizer(hf, cfg.Optimizer)
    for g in hf_opt.param_groups:
        g["lr"] = 1e-4
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50257, (args.batch, args.seq + 1), generator=g)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(args.seq).expand(args.batch, -1).contiguous(),
             "loss_mask": torch.ones(args.batch, args.seq)}
    params = [p for grp in hf_opt.param_groups for p in grp["params"]]

    def ours_step():
        trainer.train_step(batch)

    def hf_step():
        from gptforge.train.optim import clip_grad_norm_

        loss = hf(input_ids=batch["tokens"], labels=batch["tokens"]).loss
        loss.backward()
        clip_grad_norm_(params, cfg.Optimizer.grad_clip.clip_norm)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)
        return loss.item()

    return trainer, hf, ours_step, hf_step


def profile(name, fn, rows=15):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU]) as p:
        fn()
    print(f"--- {name}: top ops by self CPU time")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=6, help="rounds of one step each (order alternates)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--profile", action="store_true", help="print the top ops of one step of each")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args()

    from gptforge.train.metrics import device_name, train_flops_per_token

    if args.threads:
        torch.set_num_threads(args.threads)
    trainer, hf, ours_step, hf_step = build(args)
    for _ in range(args.warmup):
        ours_step()
        hf_step()
    times = {"gptforge": [], "transformers": []}
    cpu = {"gptforge": [], "transformers": []}
    fns = {"gptforge": ours_step, "transformers": hf_step}
    for r in range(args.rounds):
        order = ("gptforge", "transformers") if r % 2 == 0 else ("transformers", "gptforge")
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
              flush=True)
    tokens = args.batch * args.seq
    ceiling = sgemm_ceiling()
    fpt = train_flops_per_token(trainer.model, args.seq)
    res = {"device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(),
           "shape": vars(args), "sgemm_gflops": ceiling / 1e9, "flops_per_token": fpt,
           "load_avg": os.getloadavg()}
    for name, ts in times.items():
        med = statistics.median(ts)
        res[name] = {"median_step_s": med, "tokens_per_s": tokens / med, "steps_s": ts,
                     "median_cpu_s": statistics.median(cpu[name]), "mfu_vs_sgemm": fpt * tokens / med / ceiling}
    ratio = res["gptforge"]["tokens_per_s"] / res["transformers"]["tokens_per_s"]
    res["ratio"] = ratio
    print(f"\n{res['device']}, {res['threads']} threads, load average {res['load_avg'][0]:.1f}; "
          f"fp32 sgemm ceiling {ceiling / 1e9:.0f} GFLOP/s")
    print(f"shape: vocab 50304, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
          f"seq {args.seq}, batch {args.batch}, AdamW fp32, dropout 0.1")
    for name in ("gptforge", "transformers"):
        r = res[name]
        print(f"{name:>13}: {r['median_step_s']:.3f} s/step, {r['tokens_per_s']:.0f} tokens/s, "
              f"MFU vs sgemm {100 * r['mfu_vs_sgemm']:.0f}%, process CPU time {r['median_cpu_s']:.3f} s/step")
    cpu_ratio = res["transformers"]["median_cpu_s"] / res["gptforge"]["median_cpu_s"]
    res["cpu_time_ratio"] = cpu_ratio
    print(f"ratio gptforge / transformers: {ratio:.2f}x tokens/s (wall clock); "
          f"{cpu_ratio:.2f}x by process CPU time")
    if args.profile:
        profile("gptforge", ours_step)
        profile("transformers", hf_step)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
