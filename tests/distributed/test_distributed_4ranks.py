"""Two-axis layouts on 4 gloo ranks (slow: 4 processes on a 2-core machine): tensor parallel
with plain data parallel (one gradient all-reduce per step), FSDP2 over tensor parallel
(2-D DTensors, with sequence parallel), HSDP (dp replicas of sharded groups), and resumes
across these layouts, all against the single-process run."""

from __future__ import annotations

import pytest
from dist_common import SAVE_AT, SHARD, STEPS, launch, result, single_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-5
DP2, MP2, MICRO1 = "Distributed.dp_degree=2", "Distributed.mp_degree=2", "Global.micro_batch_size=1"
SAVE = f"Engine.save_load.save_steps={SAVE_AT}"
LAYOUTS = {
    "dp2_mp2": (DP2, MP2, MICRO1, SAVE),
    "sh2_mp2_sp": (*SHARD, MP2, "Distributed.sharding.sharding_stage=3", "Model.sequence_parallel=True", SAVE),
    "hsdp_dp2_sh2": (*SHARD, DP2, MICRO1, SAVE),
}


@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist4")
    single = single_run(root, "single", SAVE)
    step = lambda name: str(root / "runs" / name / f"step_{SAVE_AT}")  # noqa: E731
    jobs = [{"name": n, "overrides": o} for n, o in LAYOUTS.items()]
    jobs += [{"name": "w1_to_sh2_mp2", "overrides": (*SHARD, MP2), "resume": step("single")},
             {"name": "dp2_mp2_to_hsdp", "overrides": (*SHARD, DP2, MICRO1), "resume": step("dp2_mp2")},
             {"name": "sh2_mp2_to_dp2_mp2", "overrides": (DP2, MP2, MICRO1), "resume": step("sh2_mp2_sp")}]
    launch(root, jobs, nproc=4, timeout=600)
    return root, single


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_axis_layouts_equal_single_process(runs4, name):
    root, single = runs4
    got = result(root, name)
    assert len(got["losses"]) == STEPS
    assert got["losses"] == pytest.approx(single.losses, abs=TOL, rel=0)


@pytest.mark.parametrize("name", ["w1_to_sh2_mp2", "dp2_mp2_to_hsdp", "sh2_mp2_to_dp2_mp2"])
def test_resume_across_layouts(runs4, name):
    root, single = runs4
    assert result(root, name)["losses"] == pytest.approx(single.losses[SAVE_AT:], abs=TOL, rel=0)
