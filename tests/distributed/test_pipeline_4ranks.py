"""Pipeline parallel composed with the other axes on 4 gloo ranks (slow: 4 processes on a
2-core machine), on one ("dp", "pp", "sharding", "mp") mesh, against the single-process run:
pp2 × dp2 (a gradient all-reduce per stage over the data ranks), pp2 × mp2 (tensor parallel
inside the stages; with sequence parallel the stage boundaries carry sequence shards),
pp2 × sharding2 (FSDP2 inside the stages), and resumes across pp layouts (pp2 → pp2 × dp2,
pp2 × mp2 → dp2 × mp2 without a pipeline)."""

from __future__ import annotations

import pytest
from dist_common import PP_L4, PP_MICRO1, PP_SAVE, SAVE_AT, STEPS, launch, pp_overrides, result

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-6
DP2, MP2 = "Distributed.dp_degree=2", "Distributed.mp_degree=2"
SH2 = ("Distributed.sharding.sharding_degree=2", "Distributed.sharding.sharding_stage=3")
LAYOUTS = {
    "pp2_dp2": pp_overrides("1F1B", DP2, PP_SAVE),
    "pp2_mp2": pp_overrides("Interleaved1F1B", MP2, PP_SAVE),
    "pp2_mp2_sp": pp_overrides("1F1B", MP2, "Model.sequence_parallel=True"),
    "pp2_sh2": pp_overrides("1F1B", *SH2),
}


@pytest.fixture(scope="module")
def runs4(pp_runs):
    root, single = pp_runs  # the single-process reference and the 2-rank pp checkpoints
    step = lambda name: str(root / "runs" / name / f"step_{SAVE_AT}")  # noqa: E731
    jobs = [{"name": n, "overrides": o} for n, o in LAYOUTS.items()]
    jobs += [{"name": "pp2_to_pp2_dp2", "overrides": pp_overrides("1F1B", DP2), "resume": step("pp_1F1B")},
             {"name": "pp2_mp2_to_dp2_mp2", "overrides": (PP_L4, PP_MICRO1, DP2, MP2), "resume": step("pp2_mp2")}]
    launch(root, jobs, nproc=4, timeout=900)
    return root, single


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pp_composed_layouts_equal_single_process(runs4, name):
    root, (r, norms, _) = runs4
    got = result(root, name)
    assert len(got["losses"]) == STEPS
    # FSDP2 reduce-scatters in its own order: the same 2e-6 (loss) / 2e-5 (norm) as FSDP2 without a pipeline
    tol = 5e-6 if name == "pp2_sh2" else TOL
    assert got["losses"] == pytest.approx(r.losses, abs=tol, rel=0)
    assert got["grad_norms"] == pytest.approx(norms, rel=5e-5 if name == "pp2_sh2" else 1e-6)
    assert [v for _, v in got["eval"]] == pytest.approx([v for _, v in r.eval_losses], abs=tol, rel=0)


@pytest.mark.parametrize("name", ["pp2_to_pp2_dp2", "pp2_mp2_to_dp2_mp2"])
def test_resume_across_pp_layouts(runs4, name):
    root, (r, _, _) = runs4
    assert result(root, name)["losses"] == pytest.approx(r.losses[SAVE_AT:], abs=TOL, rel=0)
