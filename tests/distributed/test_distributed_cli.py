"""The real launch path: the `tp` job of the `dist_runs` fixture is `torchrun -m gptforge
pretrain` with tensor parallel on 2 gloo ranks; `gptforge convert` joins its distributed
checkpoint into one model directory whose weights equal the single-process run's."""

from __future__ import annotations

import pytest
import torch
from dist_common import SAVE_AT

from gptforge.model_io import load_model

pytestmark = pytest.mark.distributed


def test_torchrun_cli_then_convert_to_one_file(dist_runs, run_cli, tmp_path):
    root, single = dist_runs
    log = (root / "launch.log").read_text()
    assert log.count("gptforge pretrain: done at step 5") == 1  # rank 0 speaks for the run
    assert "distributed: 2 processes (gloo), tp: dp 1 x sharding 1 x mp 2;" in log  # backend chosen from the device
    step = root / "runs" / "tp" / f"step_{SAVE_AT}"
    code, out, err = run_cli("convert", "--src", step, "--out", tmp_path / "one")
    assert code == 0, err
    assert "joined from a distributed checkpoint" in out
    joined, cfg = load_model(tmp_path / "one")
    assert (tmp_path / "one" / "model.safetensors").is_file() and (tmp_path / "one" / "tokenizer.json").is_file()
    assert cfg.Distributed.mp_degree == 1  # one file has no parallel layout

    want, _ = load_model(root / "runs" / "single" / f"step_{SAVE_AT}")
    got, want = joined.state_dict(), want.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=k)
    # a distributed checkpoint also loads directly (`gptforge eval/generate --ckpt step_N`)
    direct, _ = load_model(step)
    assert all(torch.equal(direct.state_dict()[k], got[k]) for k in got)
