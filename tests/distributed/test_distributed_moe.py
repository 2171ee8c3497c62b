"""Expert parallel (train/parallel_ep.py): 2 gloo ranks with the experts split over them (and
plain data parallel and FSDP2 for an MoE model) equal one process over 5 steps, and the expert-parallel
distributed checkpoint resumes in one process. One process sees the same micro-batches (global
batch 4 as 2 micro-batches of 2), so routing, capacity and the balancing loss match exactly."""

from __future__ import annotations

import pytest
from dist_common import STEPS, launch, result, single_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-6
MOE = ("Model.num_experts=4", "Model.expert_interval=1", "Model.topk=1", "Model.moe_train_capacity_factor=1.0")


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_moe")
    single = single_run(root, "single", *MOE, "Engine.save_load.save_steps=-1")
    launch(root, [{"name": "ep", "overrides": (*MOE, "Distributed.ep_degree=2", "Engine.save_load.save_steps=3")},
                  {"name": "dp", "overrides": (*MOE, "Engine.save_load.save_steps=-1")},
                  {"name": "fsdp", "overrides": (*MOE, "Distributed.sharding.sharding_degree=2",
                                                 "Engine.save_load.save_steps=-1")}], nproc=2)
    return root, single


@pytest.mark.parametrize("name", ["ep", "dp", "fsdp"])
def test_world2_moe_equals_single_process(moe_runs, name):
    root, single = moe_runs
    got = result(root, name)["losses"]
    assert len(got) == STEPS
    assert got == pytest.approx(single.losses, abs=TOL, rel=0)
    assert single.losses[-1] < single.losses[0] - 0.1
    log = (root / "runs" / name / "train.log").read_text()
    assert ("x ep 2 (experts over data ranks)" in log) == (name == "ep") and "[moe] aux_loss:" in log


def test_expert_parallel_checkpoint_resumes_in_one_process(moe_runs):
    root, single = moe_runs
    resumed = single_run(root, "resumed", *MOE, "Engine.save_load.save_steps=-1",
                         resume=str(root / "runs" / "ep" / "step_3"))
    assert resumed.losses == pytest.approx(single.losses[3:], abs=TOL, rel=0)
