"""W&B and MLflow beside TensorBoard (`Engine.trackers`, docs/tracking.md): what a run logs reaches
each tracker as metrics.jsonl has it, offline, and a resumed run continues the same tracker run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gptforge.config import save_config
from gptforge.errors import ConfigError
from test_train_support import train_config


def _records(out, kind="train"):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == kind}


def test_mlflow_gets_every_step_and_the_config(tmp_path, run_cli, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = train_config(tmp_path, "Engine.trackers=[mlflow]", "Engine.tracker_project=tiny", steps=4)
    save_config(cfg, tmp_path / "run.yaml")
    code, _, err = run_cli("pretrain", "-c", tmp_path / "run.yaml", "--no-progress")
    assert code == 0, err
    out = tmp_path / "out"
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "out"
    assert client.get_experiment(run.info.experiment_id).name == "tiny"
    assert run.data.params["Engine.max_steps"] == "4" and run.data.params["Model.hidden_size"] == str(cfg.Model.hidden_size)
    history = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert history == pytest.approx({s: r["loss"] for s, r in _records(out).items()}, rel=1e-6)
    assert not (out / "tensorboard").exists()  # only the trackers named

    # resume to step 6: the same MLflow run continues
    cfg6 = train_config(tmp_path, "Engine.trackers=[mlflow]", "Engine.tracker_project=tiny", steps=6)
    save_config(cfg6, tmp_path / "run6.yaml")
    code, _, err = run_cli("pretrain", "-c", tmp_path / "run6.yaml", "--resume", "auto", "--no-progress")
    assert code == 0, err
    assert json.loads((out / "trackers.json").read_text())["mlflow"] == run_id
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert steps == sorted(_records(out)) and max(steps) == 6


def test_wandb_offline_run_is_written_and_its_service_stops(tmp_path):
    pytest.importorskip("wandb")
    cfg = train_config(tmp_path, "Engine.trackers=[tensorboard,wandb]", steps=3)
    save_config(cfg, tmp_path / "run.yaml")
    # in a child process: W&B starts a service process, which must end with the run
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    import os

    r = subprocess.run([sys.executable, "-m", "gptforge", "pretrain", "-c", str(tmp_path / "run.yaml"),
                        "--no-progress"], capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]
    files = list((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1
    data = files[0].read_bytes()
    for key in (b"train/loss", b"train/lr", b"summary/tokens_per_s"):
        assert key in data, key  # the logged metric names are in W&B's own run file
    assert (out / "tensorboard").is_dir()  # both trackers named, both written
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out / "wandb") not in ps and "wandb-core" not in ps


def test_unknown_tracker_is_one_line(tmp_path, run_cli):
    with pytest.raises(ConfigError, match=r"Engine.trackers: unknown tracker 'comet'"):
        train_config(tmp_path, "Engine.trackers=[comet]")


def test_missing_package_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from gptforge.train.trackers import check_trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'gptforge\[track\]'"):
        check_trackers(["tensorboard", "mlflow"])
