"""Two gloo ranks on CPU against one process: DDP, FSDP2 (stages 2 and 3) and tensor parallel
(with and without sequence parallel) give the same losses as the single-process run with the
same global batch, and checkpoints move between world sizes (DCP at world 2 ↔ the
single-file format at world 1). The runs come from the `dist_runs` fixture (conftest.py)."""

from __future__ import annotations

import json

import pytest
from dist_common import MUON, PARITY, SAVE_AT, STEPS, result, single_run

from gptforge.train import checkpoint as ckpt

pytestmark = pytest.mark.distributed

TOL = 1e-5  # fp32, dropout 0: only the order of float sums differs


@pytest.mark.parametrize("name", list(PARITY))
def test_world2_losses_equal_single_process(dist_runs, name):
    root, single = dist_runs
    got = result(root, name)
    assert len(got["losses"]) == STEPS
    assert got["losses"] == pytest.approx(single.losses, abs=TOL, rel=0)
    assert [s for s, _ in got["eval"]] == [s for s, _ in single.eval_losses] == [4]
    assert [v for _, v in got["eval"]] == pytest.approx([v for _, v in single.eval_losses], abs=TOL, rel=0)
    assert single.losses[-1] < single.losses[0] - 0.1  # it trained: parity is not of a constant


def test_world2_muon_equals_single_process_and_resumes(dist_runs):
    """Data parallel with Muon: every rank orthogonalizes the same all-reduced gradient; its
    state goes through the distributed checkpoint and back."""
    root, _ = dist_runs
    single = single_run(root, "single_muon", *MUON)
    got = result(root, "ddp_muon")
    # Newton-Schulz magnifies the last-bit differences of the all-reduce's summation order.
    assert got["losses"] == pytest.approx(single.losses, abs=1e-4, rel=0)
    assert single.losses[-1] < single.losses[0] - 0.1
    resumed = result(root, "ddp_muon_resume")
    assert resumed["losses"] == pytest.approx(got["losses"][SAVE_AT:], abs=1e-6, rel=0)


def test_distributed_saves_are_atomic_and_keep_last(dist_runs):
    root, _ = dist_runs
    out = root / "runs" / "fsdp2"
    assert [p.name for _, p in ckpt.list_checkpoints(out)] == ["step_4", "step_5"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # the stale temp dir is gone, no new one
    step = out / "step_5"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "config.yaml", ckpt.STATE_FILE, ckpt.META_FILE} <= {
        p.name for p in step.iterdir()}
    meta = ckpt.read_meta(step)
    assert meta["format"] == "dcp" and meta["consumed_samples"] == 5 * 4
    assert meta["distributed"] == {"world_size": 2, "dp_degree": 1, "sharding_degree": 2, "mp_degree": 1,
                                   "pp_degree": 1, "ep_degree": 1, "strategy": "fsdp"}


@pytest.mark.parametrize("name", ["resume_w1_tp", "resume_w1_fsdp3"])
def test_world1_checkpoint_resumes_at_world2(dist_runs, name):
    root, single = dist_runs
    assert result(root, name)["losses"] == pytest.approx(single.losses[SAVE_AT:], abs=TOL, rel=0)


@pytest.mark.parametrize("name", ["fsdp3", "tp"])
def test_world2_checkpoint_resumes_at_world1(dist_runs, name):
    root, single = dist_runs
    src = root / "runs" / name / f"step_{SAVE_AT}"
    assert (src / ".metadata").is_file() and not (src / "model.safetensors").exists()
    r = single_run(root, f"{name}_to_w1", resume=src)
    assert r.losses == pytest.approx(single.losses[SAVE_AT:], abs=TOL, rel=0)
    assert (r.checkpoint_dir / "model.safetensors").is_file()  # one process writes the single-file format


def test_same_layout_resume_is_exact_with_dropout(dist_runs):
    root, _ = dist_runs
    straight, resumed = result(root, "ddp_drop"), result(root, "ddp_drop_resume")
    assert resumed["losses"] == straight["losses"][2:]  # every rank's RNG continues: bit-identical


def test_dropout_masks_agree_across_a_tensor_parallel_group(dist_runs):
    root, _ = dist_runs
    a, b = (json.loads((root / f"tp_drop.rank{r}.json").read_text())["losses"] for r in (0, 1))
    assert a == b  # replicated activations drew the same masks on both ranks
