"""The 345M preset really trains on a CPU: one training step at micro batch 1, seq 1024, full
recompute, fp32, with its time and the process's peak resident memory (goal: <= 10 GB).

Each variant runs in its own process so that peak RSS (VmHWM) is its own:
- gptforge: `configs/pretrain_gpt_345M_single_card.yaml` with full recompute, through
  `Trainer.train_step` (AdamW state allocated, clipping, LR);
- transformers: `GPT2LMHeadModel` of the same shape with `gradient_checkpointing_enable()`,
  the same AdamW groups and clipping (the peer);
- with `--no-recompute`, also gptforge without recompute (what recompute saves).

    .venv/bin/python benchmarks/step_345m.py               # gptforge + transformers, 1 step each
    .venv/bin/python benchmarks/step_345m.py --steps 2 --no-recompute
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))


def _batch(seq: int):
    import torch

    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 50257, (1, seq + 1), generator=g)
    return {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(),
            "position_ids": torch.arange(seq)[None], "loss_mask": torch.ones(1, seq)}


def worker(kind: str, steps: int, seq: int) -> dict:
    """Build one variant, run `steps` training steps, return times and peak RSS."""
    import torch

    from gptforge.config import load_config
    from gptforge.train.metrics import peak_rss_bytes

    recompute = kind != "gptforge-no-recompute"
    cfg = load_config(os.path.join(ROOT, "configs", "pretrain_gpt_345M_single_card.yaml"), [
        "Global.device=cpu", "Global.global_batch_size=1", "Global.local_batch_size=1", "Global.micro_batch_size=1",
        f"Data.Train.dataset.max_seq_len={seq}", "Engine.mix_precision.enable=False",
        f"Model.use_recompute={recompute}", f"Model.recompute_granularity={'full' if recompute else ''}",
        f"Engine.save_load.output_dir={tempfile.mkdtemp(prefix='gf-345m-')}", "Optimizer.lr.warmup_rate=0"])
    t_build = time.perf_counter()
    batch = _batch(seq)
    if kind.startswith("gptforge"):
        from gptforge.data.tokenizer import gpt2_tokenizer
        from gptforge.train import Trainer

        # The step runs on a fixed synthetic batch; no corpus is read.
        trainer = Trainer(cfg, tokenizer=gpt2_tokenizer(), datasets={"Train": [batch]}, progress=False, echo=False)
        n_params = sum(p.numel() for p in trainer.model.parameters())

        def step():
            return trainer.train_step(batch)["loss"]
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        from gptforge.train.optim import build_optimizer, clip_grad_norm_
        from gptforge.train.process import tune_cpu_allocator

        tune_cpu_allocator()  # the same process setting gptforge's trainer makes
        torch.manual_seed(cfg.Global.seed)
        m = cfg.Model
        hf = GPT2LMHeadModel(GPT2Config(vocab_size=m.vocab_size, n_positions=m.max_position_embeddings,
                                        n_embd=m.hidden_size, n_layer=m.num_layers, n_head=m.num_attention_heads))
        hf.gradient_checkpointing_enable()
        hf.train()
        opt = build_optimizer(hf, cfg.Optimizer)
        params = [p for g in opt.param_groups for p in g["params"]]
        n_params = sum(p.numel() for p in hf.parameters())

        def step():
            loss = hf(input_ids=batch["tokens"], labels=batch["tokens"]).loss
            loss.backward()
            clip_grad_norm_(params, cfg.Optimizer.grad_clip.clip_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

    build_s = time.perf_counter() - t_build
    times, cpu, losses = [], [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"kind": kind, "params": n_params, "build_s": build_s, "step_s": times, "cpu_s": cpu, "loss": losses,
            "peak_rss_gb": peak_rss_bytes() / 1e9, "threads": torch.get_num_threads()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--no-peer", action="store_true", help="skip the transformers run")
    ap.add_argument("--no-recompute", action="store_true", help="also run gptforge without recompute")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.steps, args.seq)), flush=True)
        return 0

    import torch

    from gptforge.train.metrics import device_name

    kinds = ["gptforge"] + ([] if args.no_peer else ["transformers"]) + (
        ["gptforge-no-recompute"] if args.no_recompute else [])
    results = []
    for kind in kinds:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--steps", str(args.steps),
               "--seq", str(args.seq)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{kind}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        r = json.loads(lines[-1][7:])
        results.append(r)
        print(f"{kind:>22}: {r['params'] / 1e6:.1f}M params, step(s) {', '.join(f'{t:.1f}' for t in r['step_s'])} s "
              f"(process CPU {', '.join(f'{t:.1f}' for t in r['cpu_s'])} s), "
              f"peak RSS {r['peak_rss_gb']:.2f} GB, loss {r['loss'][0]:.3f}", flush=True)
    print(f"\n{device_name(torch.device('cpu'))}, {results[0]['threads']} threads, load average "
          f"{os.getloadavg()[0]:.1f}; micro batch 1, seq {args.seq}, fp32, AdamW")
    ours = results[0]
    print(f"gptforge 345M, full recompute: first step {ours['step_s'][0]:.1f} s, peak RSS {ours['peak_rss_gb']:.2f} GB "
          f"(goal <= 10 GB: {'met' if ours['peak_rss_gb'] <= 10 else 'NOT met'})")
    peer = next((r for r in results if r["kind"] == "transformers"), None)
    if peer:
        print(f"vs transformers (gradient checkpointing), last step: {peer['step_s'][-1] / ours['step_s'][-1]:.2f}x "
              f"by wall time, {peer['cpu_s'][-1] / ours['cpu_s'][-1]:.2f}x by process CPU time (runs are sequential: "
              f"wall-time ratios are only meaningful on a quiet machine); peak RSS "
              f"{peer['peak_rss_gb'] / ours['peak_rss_gb']:.2f}x lower")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
