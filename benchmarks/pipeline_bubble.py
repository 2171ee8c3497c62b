"""Measured pipeline bubble per schedule vs theory (issue 21), on gloo CPU ranks.

Each rank runs gptforge's pipeline (`init_parallel` + `ParallelContext.wrap` + the schedule's
training step on random tokens, the trainer's code path) and times its compute: every
`forward_one_chunk`, `backward_one_chunk` and `backward_weight_one_chunk` of its stages. The
bubble of a rank is 1 − compute / step wall time (idle while waiting for a neighbour, plus
send/receive overhead); the table reports the mean over ranks and steps. Theory for equal
forward and backward times: (p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(v·m+p−1) for the
interleaved and looped-BFS schedules (v stages per rank), ~0 for the zero-bubble ones once
m ≥ 2p. The peer: the same micro-batches through the whole model in one process (rank 0,
same thread count), i.e. the compute a pipeline spreads over p ranks.

    .venv/bin/python benchmarks/pipeline_bubble.py [--pp 2] [--micro 8] [--layers 8] [--hidden 256]

(launches itself under torchrun with `--pp` gloo ranks, one thread each). The last stage also
computes the loss outside `forward_one_chunk`; that time counts as its bubble.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2), ("InterleavedZeroBubble", 2),
             ("ZBVZeroBubble", 2)]


def theory(name: str, p: int, m: int, v: int) -> float:
    if "ZeroBubble" in name:
        return 0.0
    return (p - 1) / (v * m + p - 1)


def _config(args, schedule: str, v: int):
    from gptforge.config import load_config

    return load_config(overrides=[
        "Global.device=cpu", "Engine.mix_precision.enable=False", f"Model.hidden_size={args.hidden}",
        f"Model.num_layers={args.layers}", f"Model.num_attention_heads={args.hidden // 64}",
        f"Model.ffn_hidden_size={4 * args.hidden}", f"Model.vocab_size={args.vocab}", "Model.max_position_embeddings=1024",
        "Model.hidden_dropout_prob=0", "Model.attention_probs_dropout_prob=0",
        f"Global.global_batch_size={args.micro * args.mbs}", f"Global.micro_batch_size={args.mbs}",
        f"Distributed.pp_degree={args.pp}", f"Distributed.pp_schedule={schedule}", f"Model.virtual_pp_degree={v}",
        f"Data.Train.dataset.max_seq_len={args.seq}"], world_size=args.pp)


def _timed(stage, totals: list) -> None:
    """Add the wall time of each compute call of `stage` to totals[0]."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        fn = getattr(stage, name, None)
        if fn is None:
            continue

        def wrapped(*a, _fn=fn, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[0] += time.perf_counter() - t

        setattr(stage, name, wrapped)


def _batch(args, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    n = args.micro * args.mbs
    tokens = torch.randint(0, args.vocab, (n, args.seq), generator=g)
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(n, args.seq),
            "position_ids": torch.arange(args.seq).expand(n, args.seq).contiguous()}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from gptforge.model import build_model
    from gptforge.train.parallel import init_parallel

    torch.set_num_threads(1)
    rows = []
    for schedule, v in SCHEDULES:
        if args.schedules and schedule not in args.schedules:
            continue
        cfg = _config(args, schedule, v)
        torch.manual_seed(0)
        ctx = init_parallel(cfg, "cpu")
        share = ctx.wrap(build_model(cfg.Model))
        totals = [0.0]
        for st in ctx._pipe.stages:
            _timed(st, totals)
        fracs, walls = [], []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            totals[0] = 0.0
            t = time.perf_counter()
            ctx.pipeline_step(_batch(args, step))
            wall = time.perf_counter() - t
            for p in share.parameters():
                p.grad = None
            if step >= args.warmup:
                fracs.append(1 - totals[0] / wall)
                walls.append(wall)
        got = [None] * ctx.world_size
        dist.all_gather_object(got, (sum(fracs) / len(fracs), sum(walls) / len(walls)))
        rows.append({"schedule": schedule, "v": v, "bubble": sum(f for f, _ in got) / len(got),
                     "per_rank": [round(f, 4) for f, _ in got], "step_s": max(w for _, w in got),
                     "theory": theory(schedule, args.pp, args.micro, v)})
    dist.barrier()
    if ctx.rank == 0:
        rows.append({"schedule": "one process (peer)", "step_s": _single(args)})
        print("RESULT " + json.dumps(rows))
    dist.barrier()


def _single(args) -> float:
    """The same micro-batches, forward + backward through the whole model in this process."""

    from gptforge.model import build_model

    cfg = _config(args, "1F1B", 1)
    model = build_model(cfg.Model).train()
    walls = []
    for step in range(args.warmup + args.steps):
        b = _batch(args, step)
        t = time.perf_counter()
        for i in range(args.micro):
            sl = slice(i * args.mbs, (i + 1) * args.mbs)
            out = model(b["tokens"][sl], position_ids=b["position_ids"][sl], labels=b["labels"][sl])
            (out.loss / args.micro).backward()
        walls.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    return sum(walls[args.warmup:]) / args.steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step (accumulate steps)")
    ap.add_argument("--mbs", type=int, default=2, help="micro-batch size")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024,
                    help="small, so the last stage's tied projection does not unbalance the stages")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", nargs="*", help="a subset of: " + " ".join(n for n, _ in SCHEDULES))
    args = ap.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.pp}",
                          __file__, *sys.argv[1:]], env=env, capture_output=True, text=True)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        sys.exit(out.stderr[-3000:])
    rows = json.loads(lines[-1][7:])
    print(f"pp {args.pp}, {args.micro} micro-batches of {args.mbs} x {args.seq} tokens, {args.layers} layers, "
          f"hidden {args.hidden}, vocab {args.vocab}; gloo CPU ranks, 1 thread each; load average {os.getloadavg()[0]:.2f}")
    print("| schedule | stages/rank | measured bubble | per rank | theory | step (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "bubble" in r:
            print(f"| {r['schedule']} | {r['v']} | {r['bubble']:.3f} | {r['per_rank']} | {r['theory']:.3f} | "
                  f"{r['step_s']:.3f} |")
        else:
            print(f"| {r['schedule']} | — | — | — | — | {r['step_s']:.3f} |")


if __name__ == "__main__":
    main()
