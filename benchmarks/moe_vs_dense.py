"""A small MoE GPT vs the dense GPT of equal active parameters, at equal tokens, on the built-in corpus.

On the built-in corpus (this Python's standard library, byte-level BPE of 4096 tokens learned
from it), in one run and with the same data order, schedule and seed:
  - dense: GPT hidden 128, 4 layers, 4 heads, FFN 512;
  - MoE:   the same, every FFN replaced by `--experts` experts (default 8) of FFN 512 behind a
           Switch (top-1) gate: per token the same FFN compute, plus a 128 x E gate per layer;
           capacity factor `--capacity-factor` (2.0) in training, 2.0 in eval, balancing loss
           weight 0.01 (the reference's).
Both train `--steps` steps of `--batch` x `--seq` tokens (`gptforge pretrain`'s code), then are
evaluated on the same Eval-split batches. Reported: total and active parameters, eval loss and
ppl, training tokens/s, and the MoE's last routing statistics. Goal (issue 22): the MoE's
eval loss is below the dense model's.

    .venv/bin/python benchmarks/moe_vs_dense.py [--work runs/bench_moe] [--steps 500] [--experts 8] [--capacity-factor 2.0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from gptforge.config import load_config  # noqa: E402

SHAPE = ["Model.hidden_size=128", "Model.num_layers=4", "Model.num_attention_heads=4", "Model.ffn_hidden_size=512",
         "Model.vocab_size=4096", "Model.max_position_embeddings=256", "Model.hidden_dropout_prob=0",
         "Model.attention_probs_dropout_prob=0"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in have)
    except OSError:
        pass
    return "?"


def tokenizer_dir(work: Path, given: str | None) -> Path:
    from gptforge.data.corpus import builtin_documents
    from gptforge.data.tokenizer import train_tokenizer

    if given:
        return Path(given)
    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        train_tokenizer(builtin_documents(), vocab_size=4096, show_progress=False).save(tok_dir)
    return tok_dir


def run(name: str, extra: list[str], args, tok_dir: Path) -> dict:
    from gptforge.model.moe import load_stats
    from gptforge.train import Trainer

    out = args.work / name
    cfg = load_config(overrides=[
        *SHAPE, *extra, "Global.device=cpu", f"Global.global_batch_size={args.batch}",
        f"Global.micro_batch_size={args.batch}", "Engine.mix_precision.enable=False",
        f"Engine.eval_freq={args.steps}", f"Engine.eval_iters={args.eval_batches}", "Engine.logging_freq=50",
        "Engine.save_load.save_steps=-1", f"Engine.save_load.output_dir={out}", f"Engine.max_steps={args.steps}",
        "Optimizer.lr.max_lr=2e-3", "Optimizer.lr.min_lr=2e-4", "Optimizer.lr.warmup_rate=0.02",
        f"Optimizer.lr.decay_steps={args.steps}", f"Data.tokenizer={tok_dir}", "Global.seed=1234",
        *(f"Data.{s}.dataset.{k}" for s in ("Train", "Eval") for k in ("input_dir=builtin", f"max_seq_len={args.seq}")),
        "Data.Train.loader.num_workers=0", "Data.Eval.loader.num_workers=0"])
    t = Trainer(cfg, progress=False, echo=False, overwrite=True)
    total = sum(p.numel() for p in t.model.parameters())
    expert = sum(p.numel() for n, p in t.model.named_parameters() if ".moe.experts." in n)
    e = max(cfg.Model.num_experts)
    active = total - expert + (expert // e * cfg.Model.topk if expert else 0)
    t0 = time.perf_counter()
    r = t.train()
    wall = time.perf_counter() - t0
    tokens = args.steps * args.batch * args.seq
    eval_loss = r.eval_losses[-1][1]
    res = {"name": name, "params_total": total, "params_active": active, "train_tokens": tokens,
           "eval_loss": eval_loss, "eval_ppl": math.exp(eval_loss), "train_wall_s": wall,
           "train_tokens_per_s": tokens / wall, "final_train_loss": r.losses[-1]}
    stats = load_stats(t.model)
    if stats is not None:
        res["last_eval_batch_routing"] = stats
    print(json.dumps(res), file=sys.stderr)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/bench_moe"))
    ap.add_argument("--tokenizer", help="a tokenizer dir learned from the built-in corpus (else learned here)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--capacity-factor", type=float, default=2.0, help="training capacity factor (eval: 2.0)")
    ap.add_argument("--eval-batches", type=int, default=32)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tok_dir = tokenizer_dir(args.work, args.tokenizer)
    load0 = os.getloadavg()
    moe = [f"Model.num_experts={args.experts}", "Model.expert_interval=1", "Model.topk=1",
           f"Model.moe_train_capacity_factor={args.capacity_factor}", "Model.moe_eval_capacity_factor=2.0",
           "Model.balance_loss_weight=0.01"]
    dense = run("dense", [], args, tok_dir)
    sparse = run("moe", moe, args, tok_dir)
    load1 = os.getloadavg()
    out = {"cpu": cpu_name(), "flags": cpu_flags(), "cores": os.cpu_count(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "loadavg_start": load0, "loadavg_end": load1,
           "args": {k: str(v) for k, v in vars(args).items()}, "dense": dense, "moe": sparse,
           "moe_minus_dense_eval_loss": sparse["eval_loss"] - dense["eval_loss"]}
    (args.work / "result.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
