"""Structured pruning recovery: eval loss dense / pruned / pruned + fine-tuned, and forward speed.

On the built-in corpus (this Python's standard library, tokenized with a byte-level BPE of
8192 tokens learned from it), in one run:
  1. pretrain a small dense GPT with the trainer (hidden 256, 4 layers, 8 heads, FFN 1024);
  2. for each ratio (12.5 / 25 / 50 % of heads and FFN neurons, l1_norm, uniform: the
     reference recipe) run `prune_and_finetune` — the code behind `gptforge prune` — which
     writes the pruned model before fine-tuning and fine-tunes it with the trainer (no warmup,
     weight decay 0, dropout 0);
  3. continue the dense model for the same number of steps with the same recipe (the control:
     the fine-tune's extra training alone), so that the cost of pruning after recovery is
     (pruned + fine-tuned) − (dense + the same steps);
  4. evaluate every model on the same held-out batches (Eval split), and time the forward pass
     of each on the same fixed batch (best of several interleaved rounds, so that load from
     other processes hits every model alike and the least-disturbed round counts), on one
     thread (the work per core, least disturbed by other processes) and on all threads. The
     peer is the dense model: speed-ups are pruned tokens/s ÷ dense tokens/s from the same run.
  5. one-shot (no fine-tuning) eval loss at 25 % for every criterion, and of 2:4 sparsity
     (magnitude, wanda), which needs a sparse kernel (CUDA) to be faster and is not timed.

    .venv/bin/python benchmarks/prune_recovery.py [--work runs/bench_prune] [--dense-steps 300]
        [--ft-steps 100] [--ratios 0.125 0.25 0.5] [--reuse] [--quick]

Artifacts (tokenizer, dense run) are reused from --work when present; results go to
<work>/prune_recovery.json and are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from gptforge.compress.prune_run import forward_tokens_per_s, prune_and_finetune  # noqa: E402
from gptforge.config import load_config  # noqa: E402
from gptforge.config.schema import PruneConfig  # noqa: E402
from gptforge.model_io import load_model  # noqa: E402
from gptforge.transforms.prune import prune_model  # noqa: E402
from gptforge.transforms.sparsity import SparsityKeeper, compute_masks  # noqa: E402

SHAPE = ["Model.preset=mini", "Model.num_attention_heads=8", "Model.num_layers=4", "Model.vocab_size=8192",
         "Model.max_position_embeddings=512"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def tokenizer(work: Path):
    from gptforge.data.corpus import builtin_documents
    from gptforge.data.tokenizer import load_tokenizer, train_tokenizer

    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        t0 = time.perf_counter()
        tok = train_tokenizer(builtin_documents(), vocab_size=8192, show_progress=False)
        tok.save(tok_dir)
        print(f"tokenizer: {tok.vocab_size} tokens learned in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return load_tokenizer(str(tok_dir)), tok_dir


def base_overrides(work: Path, tok_dir: Path, seq: int, batch: int) -> list[str]:
    return [*SHAPE, "Global.device=cpu", f"Global.global_batch_size={batch}", f"Global.micro_batch_size={batch}",
            "Engine.mix_precision.enable=False", "Engine.eval_freq=0", "Engine.logging_freq=25",
            "Engine.save_load.save_steps=-1", f"Data.tokenizer={tok_dir}",
            *(f"Data.{s}.dataset.{k}" for s in ("Train", "Eval") for k in ("input_dir=builtin", f"max_seq_len={seq}")),
            "Data.Train.loader.num_workers=0", "Data.Eval.loader.num_workers=0"]


def pretrain_dense(work: Path, tok, tok_dir: Path, steps: int, seq: int, batch: int) -> Path:
    from gptforge.train import checkpoint as ckpt
    from gptforge.train import pretrain

    out = work / "dense"
    last = ckpt.latest_checkpoint(out)
    if last is not None and ckpt.read_meta(last)["step"] == steps:
        return last
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(overrides=[*base_overrides(work, tok_dir, seq, batch), "Model.hidden_dropout_prob=0",
                                 "Model.attention_probs_dropout_prob=0", f"Engine.max_steps={steps}",
                                 f"Engine.save_load.output_dir={out}", "Optimizer.lr.max_lr=2e-3",
                                 "Optimizer.lr.min_lr=2e-4", "Optimizer.lr.warmup_rate=0.02",
                                 f"Optimizer.lr.decay_steps={steps}"])
    t0 = time.perf_counter()
    r = pretrain(cfg, tokenizer=tok, progress=False, echo=False)
    print(f"dense: {steps} steps in {time.perf_counter() - t0:.0f}s, last loss {r.losses[-1]:.3f}", file=sys.stderr)
    return r.checkpoint_dir


def eval_batches(cfg, tok, n: int) -> list[dict]:
    from gptforge.data.dataset import build_datasets, collate

    mbs = cfg.Global.micro_batch_size
    ds = build_datasets(cfg, ("Eval",), num_samples={"Eval": n * mbs}, tokenizer=tok)["Eval"]
    return [collate([ds[k * mbs + j] for j in range(mbs)]) for k in range(n)]


@torch.no_grad()
def eval_loss(model, batches) -> float:
    model.eval()
    total = 0.0
    for b in batches:
        total += float(model(b["tokens"], position_ids=b["position_ids"], labels=b["labels"]).loss)
    return total / len(batches)


def timed(models: dict, batch: int, seq: int, rounds: int, threads: int) -> dict[str, float]:
    """Best forward tokens/s per model over `rounds` interleaved rounds (each the median of 3)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    speeds: dict[str, list[float]] = {k: [] for k in models}
    try:
        for _ in range(rounds):
            for name, m in models.items():
                speeds[name].append(forward_tokens_per_s(m, batch, seq, repeats=3))
    finally:
        torch.set_num_threads(before)
    return {k: max(v) for k, v in speeds.items()}


def finished(out: Path, steps: int) -> Path | None:
    """The step-`steps` checkpoint of a completed run in `out`, if there is one."""
    from gptforge.train import checkpoint as ckpt

    last = ckpt.latest_checkpoint(out)
    return last if last is not None and ckpt.read_meta(last)["step"] == steps else None


def ft_overrides(args, tok_dir: Path, pretrained: Path, out: Path) -> list[str]:
    """The pruning fine-tune recipe (no warmup, weight decay 0, dropout 0), also used for the control."""
    return [*base_overrides(out, tok_dir, args.seq, args.batch), f"Compress.pretrained={pretrained}",
            "Model.hidden_dropout_prob=0", "Model.attention_probs_dropout_prob=0", "Optimizer.weight_decay=0",
            "Optimizer.lr.warmup_rate=0", f"Optimizer.lr.max_lr={args.ft_lr}", f"Optimizer.lr.min_lr={args.ft_lr / 10}",
            f"Engine.max_steps={args.ft_steps}", f"Optimizer.lr.decay_steps={args.ft_steps}",
            f"Engine.save_load.output_dir={out}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench_prune")
    ap.add_argument("--dense-steps", type=int, default=300)
    ap.add_argument("--ft-steps", type=int, default=100)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=24)
    ap.add_argument("--ft-lr", type=float, default=5e-4)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for training (default: torch's)")
    ap.add_argument("--reuse", action="store_true", help="reuse finished control / pruning runs found in --work")
    ap.add_argument("--quick", action="store_true", help="tiny run to check the script (numbers meaningless)")
    args = ap.parse_args()
    if args.quick:
        args.dense_steps, args.ft_steps, args.eval_batches, args.rounds = 20, 5, 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tok, tok_dir = tokenizer(work)
    dense_dir = pretrain_dense(work, tok, tok_dir, args.dense_steps, args.seq, args.batch)
    dense, dense_cfg = load_model(dense_dir)
    batches = eval_batches(dense_cfg, tok, args.eval_batches)
    rows = [{"model": "dense", "ratio": 0.0, "params": dense.num_parameters(), "eval_loss": eval_loss(dense, batches)}]
    models = {"dense": dense}
    # the control: the dense model trained for the same extra steps with the same recipe
    from gptforge.train import pretrain

    out = work / "dense_ft"
    t0 = time.perf_counter()
    done = finished(out, args.ft_steps) if args.reuse else None
    if done is None:
        shutil.rmtree(out, ignore_errors=True)
        done = pretrain(load_config(overrides=ft_overrides(args, tok_dir, dense_dir, out)), tokenizer=tok,
                        progress=False, echo=False).checkpoint_dir
    control, _ = load_model(done)
    control_loss = eval_loss(control, batches)
    rows.append({"model": f"dense + {args.ft_steps} steps (control)", "ratio": 0.0, "params": dense.num_parameters(),
                 "eval_loss": control_loss, "ft_time_s": time.perf_counter() - t0})
    for ratio in args.ratios:
        out = work / f"prune_{ratio:g}"
        t0 = time.perf_counter()
        done = finished(out, args.ft_steps) if args.reuse and (out / "pruned").is_dir() else None
        if done is None:
            shutil.rmtree(out, ignore_errors=True)
            cfg = load_config(overrides=[*ft_overrides(args, tok_dir, dense_dir, out), "Compress.Prune.enable=True",
                                         "Compress.Prune.criterion=l1_norm", f"Compress.Prune.ratio={ratio}"])
            done = prune_and_finetune(cfg, tok, save_pruned=out / "pruned", progress=False, echo=False).checkpoint_dir
        ft_time = time.perf_counter() - t0
        pruned, _ = load_model(out / "pruned")
        tuned, _ = load_model(done)
        plan = json.loads((out / "prune_report.json").read_text())
        shape = f"{plan['layer_heads'][0]}/{plan['orig_heads'][0]} heads, {plan['layer_ffn'][0]}/{plan['orig_ffn'][0]} FFN"
        rows.append({"model": f"pruned {ratio:.1%}", "ratio": ratio, "shape": shape, "params": pruned.num_parameters(),
                     "eval_loss": eval_loss(pruned, batches)})
        tuned_loss = eval_loss(tuned, batches)
        rows.append({"model": f"pruned {ratio:.1%} + {args.ft_steps} steps", "ratio": ratio, "shape": shape,
                     "params": tuned.num_parameters(), "eval_loss": tuned_loss, "ft_time_s": ft_time,
                     "vs_control": tuned_loss - control_loss})
        models[f"pruned {ratio:.1%}"] = tuned
    # 1 thread: the least disturbed by other processes (the work per core); all threads: the machine
    speed1 = timed(models, args.batch, args.seq, args.rounds, 1)
    speedn = timed(models, args.batch, args.seq, args.rounds, torch.get_num_threads())
    for r in rows:
        key = "dense" if r["ratio"] == 0 else f"pruned {r['ratio']:.1%}"
        r["fwd_tokens_per_s_1thread"], r["speedup_1thread"] = speed1[key], speed1[key] / speed1["dense"]
        r["fwd_tokens_per_s"], r["speedup"] = speedn[key], speedn[key] / speedn["dense"]

    # One-shot comparisons at 25 %: every criterion, and 2:4 sparsity (no fine-tuning).
    calib = eval_batches_from_train(dense_cfg, tok, 4)
    oneshot = []
    for crit in ("l1_norm", "l2_norm", "taylor", "activation"):
        m, _ = load_model(dense_dir)
        prune_model(m, PruneConfig(enable=True, criterion=crit, ratio=0.25), calib)
        oneshot.append({"method": f"{crit} 25% heads+FFN", "eval_loss": eval_loss(m, batches)})
    for method in ("magnitude", "wanda"):
        m, _ = load_model(dense_dir)
        SparsityKeeper(m, compute_masks(m, method, calib)).apply()
        oneshot.append({"method": f"2:4 {method} (50% of block weights)", "eval_loss": eval_loss(m, batches)})
    total = time.perf_counter() - t_start

    print(f"\nmachine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}; total {total:.0f}s")
    print(f"model: hidden 256, 4 layers, 8 heads x 32, FFN 1024, vocab 8192; dense {args.dense_steps} steps, "
          f"fine-tune {args.ft_steps} steps (batch {args.batch} x {args.seq}); eval {args.eval_batches} batches; "
          f"forward timing batch {args.batch} x {args.seq}, best of {args.rounds} rounds\n")
    n = torch.get_num_threads()
    print(f"| model | shape | params | eval loss | ppl | loss − control | fwd tok/s 1 thread | vs dense | "
          f"fwd tok/s {n} threads | vs dense |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        gap = f"{r['vs_control']:+.3f}" if "vs_control" in r else ""
        print(f"| {r['model']} | {r.get('shape', '8 heads, 1024 FFN')} | {r['params'] / 1e6:.2f}M | {r['eval_loss']:.3f} | "
              f"{math.exp(r['eval_loss']):.1f} | {gap} | {r['fwd_tokens_per_s_1thread']:.0f} | "
              f"{r['speedup_1thread']:.2f}x | {r['fwd_tokens_per_s']:.0f} | {r['speedup']:.2f}x |")
    print("\n| one-shot (no fine-tuning) | eval loss |\n|---|---:|")
    for r in oneshot:
        print(f"| {r['method']} | {r['eval_loss']:.3f} |")
    (work / "prune_recovery.json").write_text(json.dumps({"args": vars(args), "rows": rows, "oneshot": oneshot,
                                                           "machine": cpu_name(), "total_s": total}, indent=2))
    slower = [r["model"] for r in rows if r["ratio"] > 0 and "steps" in r["model"] and r["speedup_1thread"] <= 1.0]
    if slower:
        print(f"\nWARNING: not faster than dense: {', '.join(slower)}", file=sys.stderr)
    return 0


def eval_batches_from_train(cfg, tok, n: int) -> list[dict]:
    from gptforge.compress.prune_run import calibration_batches

    return calibration_batches(cfg, tok, n)


if __name__ == "__main__":
    sys.exit(main())
