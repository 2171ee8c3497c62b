"""Constants and helpers shared by the multi-process tests and their fixture (no tests here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

STEPS, SAVE_AT = 5, 3
SHARD = ("Distributed.sharding.sharding_degree=2",)
MICRO1 = ("Global.micro_batch_size=1",)  # 2 micro-batches per rank: accumulation under no_sync
DROP = ("Model.hidden_dropout_prob=0.1", "Model.attention_probs_dropout_prob=0.1")
MUON = ("Optimizer.name=Muon",)
# world-2 runs compared step by step with the single-process run ("tp" goes through the CLI)
PARITY = {
    "ddp": MICRO1,
    "fsdp2": (*SHARD, "Distributed.sharding.sharding_stage=2", *MICRO1, "Engine.save_load.save_steps=1",
              "Engine.save_load.keep_last=2"),
    "fsdp3": (*SHARD, "Distributed.sharding.sharding_stage=3", f"Engine.save_load.save_steps={SAVE_AT}"),
    "tp": ("Distributed.mp_degree=2", f"Engine.save_load.save_steps={SAVE_AT}"),
    "tp_sp": ("Distributed.mp_degree=2", "Model.sequence_parallel=True"),
}


def single_run(root: Path, name: str, *overrides: str, resume=None):
    """One process, one thread (as each rank): same kernels, so differences are only reduction order."""
    from gptforge.train import pretrain
    from test_train_support import train_config

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return pretrain(train_config(root, f"Engine.save_load.output_dir={root / 'runs' / name}", *overrides,
                                     steps=STEPS), resume=resume, progress=False, echo=False)
    finally:
        torch.set_num_threads(n)


def result(root: Path, name: str) -> dict:
    return json.loads((root / f"{name}.json").read_text())


def launch(root: Path, jobs: list[dict], nproc: int, timeout: float = 300) -> None:
    """Run `jobs` (see run_jobs.py) in one `torchrun --standalone` launch of `nproc` gloo ranks;
    the launch's output goes to `root/launch.log`. torchrun and its ranks run in their own
    process group, so a launch that hangs past `timeout` is killed whole (no orphaned rank
    left waiting on a collective)."""
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={nproc}", str(HERE / "run_jobs.py"), str(root / "jobs.json"),
                             str(root)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        (root / "launch.log").write_text(out + err)
        raise AssertionError(f"torchrun launch did not finish in {timeout:.0f}s (killed); see {root / 'launch.log'}") from None
    (root / "launch.log").write_text(out + err)
    assert proc.returncode == 0, err[-4000:]


# pipeline parallel (test_pipeline*.py): the 4-layer tiny model, 4 micro-batches per step
PP_L4, PP_MICRO1 = "Model.num_layers=4", "Global.micro_batch_size=1"
PP2, V2 = "Distributed.pp_degree=2", "Model.virtual_pp_degree=2"
PP_SAVE = f"Engine.save_load.save_steps={SAVE_AT}"
SCHEDULES = {"1F1B": (), "GPipe": (), "Interleaved1F1B": (V2,), "LoopedBFS": (V2,),
             "InterleavedZeroBubble": (V2,), "ZBVZeroBubble": (V2,)}
FAST = ("1F1B", "Interleaved1F1B")  # the default suite; the other schedules run with the slow tests


def pp_overrides(schedule: str, *more: str) -> tuple[str, ...]:
    """A pp=2 run of `schedule` (with 2 virtual stages per rank where it needs them)."""
    return (PP_L4, PP_MICRO1, PP2, f"Distributed.pp_schedule={schedule}", *SCHEDULES[schedule], *more)


def pp_single(root: Path):
    """The single-process reference of the pipeline runs: (TrainResult, grad norms, lrs)."""
    r = single_run(root, "single", PP_L4, PP_MICRO1, PP_SAVE)
    rows = [json.loads(x) for x in (r.output_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in rows if x["kind"] == "train"]
    return r, [x["grad_norm"] for x in train], [x["lr"] for x in train]
