"""`gptforge finetune`'s run directory, like pretrain's (issue #33 items 7-8, issue #34 items 1, 4, 7):
another run's directory refused without --force, one writer at a time, a killed save's temp removed
by the next run, one metrics record per step across resumes, exact resume, SIGTERM saves the step,
and the no-YAML command line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gptforge
from gptforge.run_lock import LOCK_NAME
from test_finetune_support import finetune_yaml, sentiment_rows, tiny_model_dir, write_split
from test_interrupt import interrupt_after
from test_train_support import state_equal

ENV = {**os.environ, "PYTHONPATH": str(Path(gptforge.__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("base") / "model", "Model.max_position_embeddings=128")


@pytest.fixture(scope="module")
def sst2(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue") / "SST-2"
    write_split(root, "SST2", "train", sentiment_rows(48, 1))
    write_split(root, "SST2", "dev", sentiment_rows(16, 2))
    return root


def _yaml(tmp_path, sst2, base, out, **engine):
    return finetune_yaml(tmp_path / "f.yaml", "SST2", sst2, base, out, **engine)


def _train_steps(out: Path) -> list[int]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["kind"] == "train"]


def _weights(d: Path) -> dict:
    from safetensors.torch import load_file

    return {**load_file(str(d / "model.safetensors")), **load_file(str(d / "classifier.safetensors"))}


def _digest(out: Path) -> dict:
    return {p.name: (p / "model.safetensors").read_bytes() for p in sorted(out.glob("epoch_*"))}


def test_reuse_is_refused_without_force_and_force_starts_over(tmp_path, base, sst2, run_cli):
    out = tmp_path / "out"
    y = _yaml(tmp_path, sst2, base, out)
    code, _, err = run_cli("finetune", "-c", y, "--no-progress")
    assert code == 0, err
    before, results = _digest(out), (out / "finetune_results.json").read_text()
    metrics = (out / "metrics.jsonl").read_text()
    assert sorted(before) == ["epoch_1", "epoch_2"]

    code, _, err = run_cli("finetune", "-c", y, "-o", "Engine.num_train_epochs=1", "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(out) in err and "another run (epoch_1, epoch_2)" in err and "--resume auto" in err and "--force" in err
    assert _digest(out) == before and (out / "finetune_results.json").read_text() == results
    assert (out / "metrics.jsonl").read_text() == metrics

    code, _, err = run_cli("finetune", "-c", y, "-o", "Engine.num_train_epochs=1", "--force", "--no-progress")
    assert code == 0, err
    assert sorted(p.name for p in out.glob("epoch_*")) == ["epoch_1"]
    assert _train_steps(out) == list(range(1, 7))
    assert json.loads((out / "finetune_results.json").read_text())["epochs"] == 1
    code, _, err = run_cli("finetune", "-c", y, "--force", "--resume", "auto")
    assert code == 2 and "--force" in err
    # a finished run resumed: nothing left to do, nothing changed
    code, _, err = run_cli("finetune", "-c", y, "-o", "Engine.num_train_epochs=1", "--resume", "auto", "--no-progress")
    assert code == 0, err
    assert _train_steps(out) == list(range(1, 7))


def test_second_finetune_into_one_dir_fails_at_once_naming_the_pid(tmp_path, base, sst2, run_cli):
    out = tmp_path / "out"
    y = _yaml(tmp_path, sst2, base, out, num_train_epochs=100000, save_load={"save_epoch": 100000,
                                                                           "output_dir": str(out)})
    first = subprocess.Popen([sys.executable, "-m", "gptforge", "finetune", "-c", str(y), "--no-progress"],
                             env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
        while not (out / "train.log").is_file() and first.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        assert first.poll() is None, first.stderr.read()
        t0 = time.monotonic()
        code, _, err = run_cli("finetune", "-c", y, "-o", "Engine.num_train_epochs=1", "--no-progress")
        assert time.monotonic() - t0 < 30
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"in use by pid {first.pid} (finetune on " in err and str(out) in err
    finally:
        first.kill()
        first.wait(30)
    assert not list(out.glob("epoch_*"))


KILL_MID_SAVE = textwrap.dedent("""
    import os, signal, sys
    import gptforge.train.checkpoint as C
    real = C.write_training_state
    def dying(d, step, *a, **kw):
        real(d, step, *a, **kw)
        if step > 6:  # the second epoch's save: every file written, the directory not yet published
            os.kill(os.getpid(), signal.SIGKILL)
    C.write_training_state = dying
    from gptforge.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_sigkill_mid_save_then_resume_leaves_no_temp_and_is_exact(tmp_path, base, sst2, run_cli):
    out, ref = tmp_path / "out", tmp_path / "ref"
    y = _yaml(tmp_path, sst2, base, out, num_train_epochs=3)
    drop = ["-o", "Model.hidden_dropout_prob=0.1", "-o", "Model.attention_probs_dropout_prob=0.1"]
    proc = subprocess.run([sys.executable, "-c", KILL_MID_SAVE, "finetune", "-c", str(y), *drop, "--no-progress"],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    assert [p.name for p in out.glob("epoch_*")] == ["epoch_1"] and list(out.glob(".epoch_2.tmp-*"))
    assert _train_steps(out) == list(range(1, 13))  # epoch 2 was logged, never saved

    code, stdout, err = run_cli("finetune", "-c", y, *drop, "--resume", "auto", "--no-progress")
    assert code == 0, err
    assert f"resumed from {out / 'epoch_1'} at step 6" in stdout
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # temp and lock gone
    assert _train_steps(out) == list(range(1, 19))  # one record per step
    code, _, err = run_cli("finetune", "-c", y, *drop, "-o", f"Engine.save_load.output_dir={ref}", "--no-progress")
    assert code == 0, err
    assert state_equal(_weights(out / "epoch_3"), _weights(ref / "epoch_3"))
    got, want = (json.loads((d / "finetune_results.json").read_text()) for d in (out, ref))
    assert [e["dev"]["acc"] for e in got["evals"]] == [e["dev"]["acc"] for e in want["evals"]]
    assert got["best"]["epoch"] == want["best"]["epoch"]


def test_sigterm_saves_the_step_then_resume_continues_exactly(tmp_path, base, sst2, run_cli):
    out, ref = tmp_path / "out", tmp_path / "ref"
    y = _yaml(tmp_path, sst2, base, out, num_train_epochs=8)  # 48 steps: the schedule spans them all
    done = interrupt_after(["finetune", "-c", str(y), "--no-progress"], out, 3, signal.SIGTERM)
    assert done.returncode == 143, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # The step the signal lands in is saved: a step_N directory, or the epoch's own checkpoint when
    # it landed in an epoch's last step (a loaded machine delivers it late).
    said = re.search(r"SIGTERM at step (\d+): checkpoint (\S+?);", done.stderr)
    assert said, done.stderr
    n, saved = int(said.group(1)), Path(said.group(2))
    assert 3 <= n < 48 and saved.is_dir() and saved.parent == out, done.stderr
    assert saved.name == f"step_{n}" or (saved.name.startswith("epoch_") and n % 6 == 0), done.stderr
    assert len(list(out.glob("step_*"))) <= 1
    assert not (out / LOCK_NAME).exists()

    code, _, err = run_cli("finetune", "-c", y, "--resume", "auto", "--no-progress")
    assert code == 0, err
    code, _, err = run_cli("finetune", "-c", y, "-o", f"Engine.save_load.output_dir={ref}", "--no-progress")
    assert code == 0, err
    assert state_equal(_weights(out / "epoch_8"), _weights(ref / "epoch_8"))
    assert _train_steps(out) == list(range(1, 49))


def test_finetune_without_yaml_runs_the_cpu_recipe(tmp_path, base, sst2, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "ft"
    code, stdout, err = run_cli("finetune", "--ckpt", base, "--task", "SST2", "--data", sst2, "--out", out,
                                "--no-progress")
    assert code == 0, err
    res = json.loads((out / "finetune_results.json").read_text())
    assert sorted(p.name for p in out.glob("epoch_*")) == ["epoch_1", "epoch_2", "epoch_3"]
    assert [e["epoch"] for e in res["evals"]] == [1, 2, 3] and res["steps"] == 3 * (48 // 16)
    from gptforge.config import load_config

    cfg = load_config(out / "epoch_3" / "config.yaml")
    assert cfg.Optimizer.lr.max_lr == 1e-4 and cfg.Data.Train.sampler.batch_size == 16
    best = res["best"]
    assert best["checkpoint"] == str(out / f"epoch_{best['epoch']}") == res["best_checkpoint"]
    line, where = stdout.strip().splitlines()[-1], out / f"epoch_{best['epoch']}"
    assert f"best (epoch {best['epoch']}): dev {best['main']:.4f} -> {where}" in line
    assert ("; last: " in line) == (best["epoch"] != 3)
    code, _, err = run_cli("finetune", "--ckpt", base, "--task", "SST2", "--out", tmp_path / "x", "--no-progress")
    assert code == 2 and "Data.Train.dataset.root: not set" in err and "--data DIR" in err
