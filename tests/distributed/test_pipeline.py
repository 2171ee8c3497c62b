"""Pipeline parallel on 2 gloo ranks (torch.distributed.pipelining) against one process: every
schedule gives the losses, gradient norms (global-norm clipping across the stages), learning
rates and eval loss of the single-process run with the same global batch; the loss rank 0
logs comes from the last stage; the end-of-run DCP checkpoint resumes in one process, a
single-process checkpoint resumes under pp, and `gptforge convert` joins it into one file.

The 4-layer tiny model runs 4 micro-batches per step (the accumulate steps), split into 2
stages (1 layer per stage with 2 virtual stages per rank)."""

from __future__ import annotations

import pytest
import torch
from dist_common import (
    FAST,
    MUON,
    PP_L4,
    PP_MICRO1,
    SAVE_AT,
    SCHEDULES,
    STEPS,
    launch,
    pp_overrides,
    pp_single,
    result,
    single_run,
)

from gptforge.train import checkpoint as ckpt

pytestmark = pytest.mark.distributed

TOL = 1e-6  # fp32, dropout 0: only the order of float sums may differ


@pytest.fixture(scope="module")
def pp_runs_slow(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_slow")
    single = pp_single(root)
    jobs = [{"name": f"pp_{s}", "overrides": pp_overrides(s)} for s in SCHEDULES if s not in FAST]
    # full recompute in segments of 2 blocks per stage (the reference's pp_recompute_interval)
    jobs.append({"name": "pp_recompute2", "overrides": pp_overrides("1F1B", "Model.use_recompute=True",
                                                           "Distributed.pp_recompute_interval=2")})
    jobs.append({"name": "pp_bf16", "overrides": pp_overrides("1F1B", "Engine.mix_precision.enable=True",
                                                              "Engine.mix_precision.dtype=bfloat16")})
    launch(root, jobs, nproc=2, timeout=600)
    return root, single


def _check_parity(root, single, name):
    r, norms, lrs = single
    got = result(root, name)
    assert len(got["losses"]) == STEPS
    assert got["losses"] == pytest.approx(r.losses, abs=TOL, rel=0)
    assert got["grad_norms"] == pytest.approx(norms, abs=1e-5, rel=1e-6)
    assert got["lrs"] == pytest.approx(lrs, rel=1e-12)
    assert [s for s, _ in got["eval"]] == [s for s, _ in r.eval_losses] == [4]
    assert [v for _, v in got["eval"]] == pytest.approx([v for _, v in r.eval_losses], abs=TOL, rel=0)
    assert min(norms) > 1.0  # clip_norm 1.0 scaled every step: the global norm must be right
    assert r.losses[-1] < r.losses[0] - 0.1  # it trained: parity is not of a constant


@pytest.mark.parametrize("schedule", FAST)
def test_pp2_equals_single_process(pp_runs, schedule):
    root, single = pp_runs
    _check_parity(root, single, f"pp_{schedule}")


def test_pp2_muon_equals_single_process(pp_runs):
    """Each stage's Muon orthogonalizes its own blocks' matrices: the same update as one process."""
    root, _ = pp_runs
    single = single_run(root, "single_muon", PP_L4, PP_MICRO1, *MUON)
    got = result(root, "pp_muon")
    assert got["losses"] == pytest.approx(single.losses, abs=1e-4, rel=0)  # Newton-Schulz: see the DDP test
    assert single.losses[-1] < single.losses[0] - 0.1


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"pp_{s}" for s in SCHEDULES if s not in FAST] + ["pp_recompute2"])
def test_pp2_other_schedules_equal_single_process(pp_runs_slow, name):
    root, single = pp_runs_slow
    _check_parity(root, single, name)


def test_pp_header_and_end_of_run_checkpoint(pp_runs):
    root, _ = pp_runs
    out = root / "runs" / "pp_1F1B"
    log = (out / "train.log").read_text()
    assert "distributed: 2 processes (gloo), pp: dp 1 x pp 2 (1F1B, 4 micro-batches) x sharding 1 x mp 1;" in log
    assert [p.name for _, p in ckpt.list_checkpoints(out)] == [f"step_{SAVE_AT}", f"step_{STEPS}"]
    step = out / f"step_{STEPS}"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in step.iterdir()}
    meta = ckpt.read_meta(step)
    assert meta["distributed"]["pp_degree"] == 2 and meta["distributed"]["strategy"] == "pp"


def test_single_process_checkpoint_resumes_underpp_overrides(pp_runs):
    root, (r, _, _) = pp_runs
    assert result(root, "w1_to_pp")["losses"] == pytest.approx(r.losses[SAVE_AT:], abs=TOL, rel=0)


def test_pp_checkpoint_resumes_in_one_process(pp_runs):
    root, (r, _, _) = pp_runs
    src = root / "runs" / "pp_Interleaved1F1B" / f"step_{SAVE_AT}"
    got = single_run(root, "pp_to_w1", PP_L4, PP_MICRO1, resume=src)
    assert got.losses == pytest.approx(r.losses[SAVE_AT:], abs=TOL, rel=0)


def test_convert_joins_pp_checkpoint(pp_runs, run_cli, tmp_path):
    from gptforge.model_io import load_model

    root, _ = pp_runs
    code, out, err = run_cli("convert", "--src", root / "runs" / "pp_1F1B" / f"step_{STEPS}", "--out", tmp_path / "one")
    assert code == 0, err
    joined, cfg = load_model(tmp_path / "one")
    assert cfg.Distributed.pp_degree == 1
    want, _ = load_model(root / "runs" / "single" / f"step_{STEPS}")
    got, want = joined.state_dict(), want.state_dict()
    assert got.keys() == want.keys()  # every stage's blocks, the embeddings and the final norm
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=k)


@pytest.mark.slow
def test_pp2_trains_in_bf16(pp_runs_slow):
    root, (r, _, _) = pp_runs_slow
    got = result(root, "pp_bf16")["losses"]
    # bf16 autocast through the schedule: the fp32 run's losses within bf16 rounding
    assert got == pytest.approx(r.losses, abs=2e-3, rel=0) and got != r.losses
