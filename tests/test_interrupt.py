"""Ctrl-C / SIGTERM during training (issue #34 item 7): the run saves the step it is on, exits
with 128 + the signal, and `--resume auto` continues bit-identically to a run never stopped."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gptforge
from gptforge.train import checkpoint as ckpt
from test_train_support import state_equal, train_config

ENV = {**os.environ, "PYTHONPATH": str(Path(gptforge.__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 40  # the data order depends on the run length: the reference runs as many steps


def _records(out: Path, kind: str = "train") -> list[dict]:
    if not (out / "metrics.jsonl").is_file():
        return []
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            rows.append(json.loads(line))
    return [r for r in rows if r["kind"] == kind]


def interrupt_after(argv: list[str], out: Path, steps: int, signum: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `gptforge *argv`, send `signum` once `steps` train records are logged, and wait."""
    proc = subprocess.Popen([sys.executable, "-m", "gptforge", *argv], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + timeout
        while proc.poll() is None and len(_records(out)) < steps and time.monotonic() < end:
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()[1]
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def _weights(d: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def test_sigint_saves_the_current_step_and_resume_is_bit_identical(tmp_path, run_cli):
    from gptforge.config import save_config

    cfg_file = tmp_path / "run.yaml"
    save_config(train_config(tmp_path, "Engine.save_load.save_steps=-1", "Engine.eval_freq=-1", dropout=0.1,
                             steps=STEPS), cfg_file)
    out = tmp_path / "out"
    done = interrupt_after(["pretrain", "-c", str(cfg_file), "--no-progress"], out, 3, signal.SIGINT)
    assert done.returncode == 130, done.stderr
    steps = ckpt.list_checkpoints(out)
    assert len(steps) == 1, done.stderr  # the only save: the step the signal arrived in
    n, saved = steps[0]
    assert 3 <= n < STEPS and ckpt.read_meta(saved)["step"] == n
    assert "SIGINT" in done.stderr and f"SIGINT at step {n}: checkpoint {saved}" in done.stderr
    assert "Traceback" not in done.stderr
    stop = _records(out, "stop")
    assert stop[-1]["reason"] == "signal" and stop[-1]["signal"] == "SIGINT" and stop[-1]["step"] == n
    assert not (out / ".gptforge.lock").exists()

    # --resume auto goes on from there to the end: equal to a run never interrupted
    code, _, err = run_cli("pretrain", "-c", cfg_file, "--resume", "auto", "--no-progress")
    assert code == 0, err
    ref = tmp_path / "ref"
    code, _, err = run_cli("pretrain", "-c", cfg_file, "-o", f"Engine.save_load.output_dir={ref}", "--no-progress")
    assert code == 0, err
    assert state_equal(_weights(out / f"step_{STEPS}"), _weights(ref / f"step_{STEPS}"))
    assert [r["step"] for r in _records(out)] == list(range(1, STEPS + 1))
