"""The runs every multi-process test reads: one single-process reference run and one torchrun
launch of 2 gloo ranks that runs every world-2 job (process start-up is most of the cost)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_common import DROP, MUON, PARITY, SAVE_AT, SHARD, STEPS, launch, single_run


def _jobs(root: Path) -> list[dict]:
    from gptforge.config import save_config
    from test_train_support import train_config

    step3 = str(root / "runs" / "single" / f"step_{SAVE_AT}")
    tp_yaml = root / "tp.yaml"
    save_config(train_config(root, f"Engine.save_load.output_dir={root / 'runs' / 'tp'}", *PARITY["tp"],
                             steps=STEPS), tp_yaml)
    return [
        *({"name": n, "overrides": o} for n, o in PARITY.items() if n != "tp"),
        {"name": "tp", "cli": ["pretrain", "-c", str(tp_yaml), "--no-progress"]},
        {"name": "resume_w1_tp", "overrides": ("Distributed.mp_degree=2",), "resume": step3},
        {"name": "resume_w1_fsdp3", "overrides": (*SHARD, "Distributed.sharding.sharding_stage=3"), "resume": step3},
        {"name": "ddp_drop", "overrides": (*DROP, "Engine.save_load.save_steps=2"), "steps": 4},
        {"name": "ddp_drop_resume", "overrides": DROP, "steps": 4,
         "resume": str(root / "runs" / "ddp_drop" / "step_2")},
        {"name": "tp_drop", "overrides": (*DROP, "Distributed.mp_degree=2"), "steps": 2, "all_ranks": True},
        {"name": "ddp_muon", "overrides": (*MUON, f"Engine.save_load.save_steps={SAVE_AT}")},
        {"name": "ddp_muon_resume", "overrides": MUON, "resume": str(root / "runs" / "ddp_muon" / f"step_{SAVE_AT}")},
    ]


@pytest.fixture(scope="session")
def dist_runs(tmp_path_factory):
    """(root, single-process TrainResult); world-2 results via `result(root, name)`."""
    root = tmp_path_factory.mktemp("dist")
    single = single_run(root, "single", f"Engine.save_load.save_steps={SAVE_AT}")
    (root / "runs" / "fsdp2" / ".step_9.tmp-dist").mkdir(parents=True)  # a torn save of a killed run
    launch(root, _jobs(root), nproc=2)
    return root, single



@pytest.fixture(scope="session")
def pp_runs(tmp_path_factory):
    """Pipeline parallel on 2 ranks (the FAST schedules, a world-1 → pp resume):
    (root, (single TrainResult, grad norms, lrs)); results via `result(root, name)`."""
    from dist_common import FAST, PP_SAVE, pp_overrides, pp_single

    root = tmp_path_factory.mktemp("pp")
    single = pp_single(root)
    jobs = [{"name": f"pp_{s}", "overrides": pp_overrides(s, PP_SAVE)} for s in FAST]
    jobs.append({"name": "w1_to_pp", "overrides": pp_overrides("1F1B"),
                 "resume": str(root / "runs" / "single" / f"step_{SAVE_AT}")})
    jobs.append({"name": "pp_muon", "overrides": pp_overrides("1F1B", *MUON)})
    launch(root, jobs, nproc=2)
    return root, single
