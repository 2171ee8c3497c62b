"""The 345M recipe on a GPU: tokens/s, MFU and peak memory of `gptforge pretrain`, against
`transformers` GPT2LMHeadModel of the same shape trained the same way, in one run.

Each gptforge variant is the real CLI, `gptforge pretrain -c configs/pretrain_gpt_345M_single_card.yaml`
(global = micro batch 8, seq 1024, AdamW fused, clipping 1.0) on the built-in corpus (prepared on
first use), for `--steps` steps in bf16 and fp16 (dynamic loss scale), eager and with
`Engine.compile=True`. Throughput is the median of the per-step log records after `--warmup`
steps; peak memory is `torch.cuda.max_memory_allocated` as the trainer reports it.

The peer is `transformers.GPT2LMHeadModel` (SDPA attention) of the same shape, dropout 0.1,
with the same batch, the same fused AdamW with the same parameter groups, clipping, and autocast
(+ GradScaler for fp16), fed random tokens; its loss uses transformers' own loss function.
The peer runs in-process after the gptforge runs (each gptforge run is its own process).

    python benchmarks/gpu_pretrain.py --out results_dir            # on a machine with a GPU
    python benchmarks/gpu_pretrain.py --tiny --steps 6 --warmup 2  # smoke test on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

TINY = ["Model.hidden_size=64", "Model.num_layers=2", "Model.num_attention_heads=2", "Global.micro_batch_size=2",
        "Global.local_batch_size=2", "Data.Train.dataset.max_seq_len=64", "Data.Eval.dataset.max_seq_len=64",
        "Global.device=cpu", "Engine.mix_precision.enable=False"]


def run_ours(name: str, extra: list[str], args, work: Path) -> dict:
    """One `gptforge pretrain` process; returns its steady-state figures from metrics.jsonl."""
    out = work / name
    cmd = [sys.executable, "-m", "gptforge", "pretrain", "-c", str(ROOT / "configs/pretrain_gpt_345M_single_card.yaml"),
           "-o", f"Engine.max_steps={args.steps}", "-o", "Engine.logging_freq=1",
           "-o", f"Engine.eval_freq={args.steps + 1}", "-o", f"Engine.save_load.save_steps={args.steps + 1}",
           "-o", f"Engine.save_load.output_dir={out}", "-o", "Data.Train.dataset.input_dir=builtin",
           "-o", "Data.Eval.dataset.input_dir=builtin", "-o", "Optimizer.lr.warmup_rate=0.01",
           "-o", f"Optimizer.lr.decay_steps={args.steps * 10}"]
    for o in extra + (TINY if args.tiny else []):
        cmd += ["-o", o]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(f"{name}: FAILED (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
        return {"name": name, "error": proc.stderr[-500:]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train" and r["step"] > args.warmup]
    summary = next(r for r in rows if r["kind"] == "summary")
    tps = statistics.median(r["tokens_per_s"] for r in train)
    mfus = [r["mfu"] for r in train if r.get("mfu") is not None]
    res = {"name": name, "tokens_per_s": tps, "mfu": statistics.median(mfus) if mfus else None,
           "step_ms": statistics.median(r["step_time"] for r in train) * 1e3,
           "peak_mem_gib": summary["peak_memory_bytes"] / 2**30, "device": summary["device"],
           "first_loss": next(r for r in rows if r["kind"] == "train")["loss"], "last_loss": train[-1]["loss"],
           "found_inf": sum(r.get("found_inf") or 0 for r in rows if r["kind"] == "train"), "wall_s": wall,
           "command": "gptforge pretrain -c configs/pretrain_gpt_345M_single_card.yaml "
                      + " ".join(f"-o {o}" for o in extra)}
    print(f"{name}: {tps:,.0f} tokens/s, MFU {res['mfu']}, {res['step_ms']:.1f} ms/step, peak "
          f"{res['peak_mem_gib']:.2f} GiB, loss {res['first_loss']:.3f} -> {res['last_loss']:.3f}", flush=True)
    return res


def run_peer(dtype_name: str, args) -> dict:
    """transformers GPT2LMHeadModel, same shape/batch/optimizer/precision, random tokens."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gptforge.config import load_config
    from gptforge.model import build_model
    from gptforge.train.metrics import peak_flops, train_flops_per_token

    overrides = TINY if args.tiny else []
    cfg = load_config(str(ROOT / "configs/pretrain_gpt_345M_single_card.yaml"), overrides)
    m, g = cfg.Model, cfg.Global
    seq = cfg.Data.Train.dataset.max_seq_len
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    hf_cfg = GPT2Config(vocab_size=m.vocab_size, n_positions=m.max_position_embeddings, n_embd=m.hidden_size,
                        n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size,
                        activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    hf = GPT2LMHeadModel._from_config(hf_cfg, attn_implementation="sdpa").to(dev).train()
    decay = [p for n, p in hf.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in hf.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=5e-5, fused=dev.type == "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype_name)
    scaler = torch.amp.GradScaler(dev.type, init_scale=32768.0) if dtype == torch.float16 else None
    gen = torch.Generator().manual_seed(0)
    B = g.micro_batch_size
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(args.steps):
        ids = torch.randint(0, m.vocab_size, (B, seq + 1), generator=gen).to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        ctx = torch.autocast(dev.type, dtype=dtype) if dtype is not None else torch.autocast(dev.type, enabled=False)
        with ctx:
            loss = hf(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times[args.warmup:])
    tps = B * seq / step_s
    peak = peak_flops(dev, dtype_name if dtype is not None else "fp32")
    mfu = train_flops_per_token(build_model(m, device="meta"), seq) * tps / peak if peak else None
    mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    res = {"name": f"transformers-{dtype_name}", "tokens_per_s": tps, "mfu": mfu, "step_ms": step_s * 1e3,
           "peak_mem_gib": mem, "last_loss": float(loss.detach())}
    print(f"{res['name']}: {tps:,.0f} tokens/s, MFU {mfu}, {step_s * 1e3:.1f} ms/step, peak {mem:.2f} GiB", flush=True)
    del hf, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the medians (allocator, compile)")
    ap.add_argument("--variants", nargs="+", default=["bf16", "fp16", "bf16-compile", "fp16-compile"])
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a tiny fp32 shape on the CPU (smoke test of this script)")
    ap.add_argument("--out", default=None, help="write results.json and results.md here")
    ap.add_argument("--work", default=None, help="run directories (default: a temporary directory)")
    args = ap.parse_args(argv)

    import torch

    work = Path(args.work or tempfile.mkdtemp(prefix="gf-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}", flush=True)
    results = []
    for v in args.variants:
        dtype, _, comp = v.partition("-")
        extra = [] if args.tiny else ["Engine.mix_precision.enable=True",
                                      f"Engine.mix_precision.dtype={'bfloat16' if dtype == 'bf16' else 'float16'}"]
        if comp == "compile":
            extra.append("Engine.compile=True")
        results.append(run_ours(f"gptforge-{v}", extra, args, work))
    if not args.no_peer:
        for dtype in sorted({v.partition("-")[0] for v in args.variants}):
            results.append(run_peer("fp32" if args.tiny else dtype, args))

    ok = [r for r in results if "error" not in r]
    peers = {r["name"].split("-")[1]: r for r in ok if r["name"].startswith("transformers")}
    lines = ["| run | tokens/s | vs transformers | MFU | ms/step | peak memory (GiB) |", "|---|---|---|---|---|---|"]
    for r in ok:
        dtype = "fp32" if args.tiny else r["name"].split("-")[1]
        peer = peers.get(dtype)
        ratio = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else "n/a"
        lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {ratio} | {fmt(r['mfu'], '.1%')} | "
                     f"{r['step_ms']:.1f} | {r['peak_mem_gib']:.2f} |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "steps": args.steps, "warmup": args.warmup}
        (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        (out / "results.md").write_text(table + "\n")
        for log in work.glob("*.log"):
            (out / log.name).write_text(log.read_text()[-20000:])
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
