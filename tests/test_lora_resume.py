"""A LoRA `gptforge sft` run killed with SIGKILL mid-run and resumed with `--resume auto` ends
bit-identical to a run never stopped: adapters, optimizer state and every step's loss (issue #31).

The reference runs in this process and the killed run in a fresh one: this caught the adapters'
initial A being drawn from whatever the process's RNG held (finetune/sft.apply_method now draws
it from Global.seed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gptforge
from gf_testutil import spread_gpt2_vocab_dir
from gptforge.data.synthetic_instructions import write_set
from test_train_support import state_equal

ENV = {**os.environ, "PYTHONPATH": str(Path(gptforge.__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
STEPS = 24  # the lr schedule spans the run length: the reference runs as many steps

pytestmark = pytest.mark.usefixtures("one_thread")


def _args(base: Path, files: dict, out: Path) -> list[str]:
    # Adapter dropout 0.1 so that the resumed run also needs the checkpoint's RNG state.
    return ["sft", "--ckpt", str(base), "--data", str(files["train"]), "--out", str(out), "--method", "lora",
            "-o", "Instruct.lora.targets=all", "-o", "Instruct.lora.r=4", "-o", "Instruct.lora.dropout=0.1",
            "-o", "Global.global_batch_size=4", "-o", "Data.Train.dataset.max_seq_len=48",
            "-o", "Engine.save_load.save_steps=2", "-o", f"Instruct.max_steps={STEPS}",
            "-o", "Optimizer.lr.max_lr=1e-2", "--no-progress"]


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def _state(step_dir: Path) -> tuple[dict, dict]:
    """(adapter tensors of the step checkpoint, its optimizer state flattened to tensors)."""
    from safetensors.torch import load_file

    weights = load_file(str(step_dir / "model.safetensors"))
    adapters = {k: v for k, v in weights.items() if ".adapters." in k}
    opt = torch.load(step_dir / "training_state.pt", weights_only=False)["optimizer"]
    flat = {f"{i}.{k}": v if torch.is_tensor(v) else torch.tensor(v)
            for i, s in opt["state"].items() for k, v in s.items()}
    return adapters, flat


def _kill_after_first_checkpoint(argv: list[str], out: Path, timeout: float = 300) -> int:
    """Start `gptforge *argv`, SIGKILL it as soon as a step checkpoint is published; its exit code."""
    proc = subprocess.Popen([sys.executable, "-m", "gptforge", *argv], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + timeout
        while proc.poll() is None and not list(out.glob("step_*")) and time.monotonic() < end:
            time.sleep(0.005)
        assert proc.poll() is None, proc.communicate()[1]  # still running: the kill lands mid-run
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.mark.slow  # three sft runs, one of them a fresh process: ~1 min idle, 3 min on a loaded machine
def test_sigkilled_lora_run_resumes_bit_identical(tmp_path, run_cli):
    base = spread_gpt2_vocab_dir(tmp_path / "base")
    files = write_set(tmp_path / "data", n_train=48, n_test=4)
    ref, out = tmp_path / "ref", tmp_path / "run"
    code, _, err = run_cli(*_args(base, files, ref))
    assert code == 0, err

    assert _kill_after_first_checkpoint(_args(base, files, out), out) == -signal.SIGKILL
    saved = sorted(int(p.name.split("_")[1]) for p in out.glob("step_*"))
    assert saved and saved[-1] < STEPS and not (out / "adapter").exists()

    code, stdout, err = run_cli(*_args(base, files, out), "--resume", "auto")
    assert code == 0, err
    assert f"resumed from {out / f'step_{saved[-1]}'} at step {saved[-1]}" in stdout

    want, got = _state(ref / f"step_{STEPS}"), _state(out / f"step_{STEPS}")
    assert want[0] and want[1] and state_equal(want[0], got[0]) and state_equal(want[1], got[1])
    from safetensors.torch import load_file

    assert state_equal(load_file(str(ref / "adapter" / "adapter_model.safetensors")),
                       load_file(str(out / "adapter" / "adapter_model.safetensors")))
    # Every step's loss, the steps after the resume included, is the reference's: the resumed run
    # trains on the same rows in the same order. Were the data position not restored, the step
    # after the checkpoint would take the first batch again (another loss, and other adapters
    # above); were the RNG not restored, the adapter dropout masks (and so the adapters) would differ.
    ref_losses, losses = _losses(ref), _losses(out)
    assert list(ref_losses) == list(range(1, STEPS + 1))
    assert all(losses[s] == ref_losses[s] for s in ref_losses), (losses, ref_losses)
    assert len({round(v, 6) for v in ref_losses.values()}) > STEPS // 2  # batches differ step to step
