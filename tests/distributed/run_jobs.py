"""Driver for the multi-process tests, launched once under torchrun (not a test module).

    python -m torch.distributed.run --standalone --nproc_per_node=2 run_jobs.py JOBS.json ROOT

Each job is one training run on every rank, joining the process group from torchrun's
environment the way `gptforge pretrain` does (and leaving it at the end): either the Python
API (`overrides`, optional `resume`, `steps`) or the CLI (`cli`: arguments after `gptforge`).
Rank 0 writes `ROOT/<name>.json` with the per-step losses and eval losses it logged (every
rank writes `<name>.rank<r>.json` when the job sets `all_ranks`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # tests/: the shared training helpers


def _from_metrics(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"losses": [r["loss"] for r in rows if r["kind"] == "train"],
            "eval": [[r["step"], r["loss"]] for r in rows if r["kind"] == "eval"]}


def _step_records(out: Path) -> dict:
    """Per-step gradient norms and learning rates rank 0 logged."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    return {"grad_norms": [r["grad_norm"] for r in train], "lrs": [r["lr"] for r in train]}


def main(jobs_file: str, root: str) -> None:
    from gptforge.cli import main as cli
    from gptforge.train import pretrain
    from test_train_support import train_config

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    root_p = Path(root)
    for job in json.loads(Path(jobs_file).read_text()):
        out = root_p / "runs" / job["name"]
        if "cli" in job:
            code = cli(job["cli"])
            if code != 0:
                raise SystemExit(f"job {job['name']}: gptforge exited {code}")
            res = _from_metrics(out) if rank == 0 else None
        else:
            cfg = train_config(root_p, f"Engine.save_load.output_dir={out}", *job.get("overrides", ()),
                               steps=job.get("steps", 5))
            r = pretrain(cfg, resume=job.get("resume"), progress=False, echo=False)
            res = {"losses": r.losses, "eval": r.eval_losses}
            if rank == 0:
                res.update(_step_records(out))
        name = f"{job['name']}.rank{rank}" if job.get("all_ranks") else job["name"]
        if res is not None and (rank == 0 or job.get("all_ranks")):
            (root_p / f"{name}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main(*sys.argv[1:3])
