"""Fault injection, slow suite (issue #16; `make test-all`): SIGKILL `pretrain`, `qat`, `prune`
and `preprocess` subprocesses at random moments and in the middle of a checkpoint save, resume
each time with `--resume auto` (preprocess: run again), and check

- the finished run is bit-identical to an uninterrupted one (weights / token files),
- no process of a killed run is left (DataLoader / preprocess workers included),
- after every kill each `step_N` that exists is complete and loads (nothing half-written
  looks finished), and the finished run's metrics.jsonl has one train record per step.

`GPTFORGE_FAULT_SEED` picks the kill moments (default 0); `GPTFORGE_FAULT_KILLS` how many per
verb (default 4, half of them mid-save). docs/reliability.md records the last outcome.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gptforge
from gptforge.train import checkpoint as ckpt
from test_train_support import state_equal, train_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

ENV = {**os.environ, "PYTHONPATH": str(Path(gptforge.__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
SEED = int(os.environ.get("GPTFORGE_FAULT_SEED", "0"))
KILLS = int(os.environ.get("GPTFORGE_FAULT_KILLS", "4"))
STEPS = 24


def _weights(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(step_dir / "model.safetensors"))


def _check_steps_complete(out: Path) -> None:
    """Every visible step_N directory is a complete, loadable checkpoint of step N."""
    for d in out.glob("step_*"):
        assert ckpt.is_complete(d), f"{d} looks like a checkpoint but is incomplete: {sorted(os.listdir(d))}"
        assert ckpt.read_meta(d)["step"] == int(d.name.split("_")[1])
        _weights(d)
        import torch

        torch.load(d / ckpt.STATE_FILE, weights_only=True)


class Killer:
    """Runs one command to completion through `kills` SIGKILLs; records what each kill hit."""

    def __init__(self, argv: list[str], watch: Path, rng: random.Random, log: Path):
        self.argv, self.watch, self.rng, self.log = argv, watch, rng, log
        self.outcomes: list[str] = []

    def _start(self) -> subprocess.Popen:
        f = open(self.log, "a")  # noqa: SIM115 - handed to the child
        return subprocess.Popen([sys.executable, "-m", "gptforge", *self.argv], env=ENV, stdout=f, stderr=f)

    def _descendants(self, proc: subprocess.Popen) -> list:
        import psutil

        try:
            return psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def _wait_started(self, proc: subprocess.Popen, started) -> bool:
        while proc.poll() is None:
            if started():
                return True
            time.sleep(0.01)
        return False

    def run(self, kills: int, started, mid_save, after_kill) -> int:
        """`started()`: the child is at work; `mid_save()`: a save is in flight now;
        `after_kill()`: checks of the directory a kill left. Returns the kills done."""
        import psutil

        done = 0
        for k in range(kills):
            proc = self._start()
            seen: dict[int, psutil.Process] = {}
            last = [0.0]

            def snapshot(proc=proc, seen=seen, last=last, force: bool = False) -> None:
                if force or time.monotonic() - last[0] > 0.2:  # children() walks /proc: not every poll
                    for p in self._descendants(proc):
                        seen[p.pid] = p
                    last[0] = time.monotonic()

            if not self._wait_started(proc, started):
                self.outcomes.append("finished before kill")
                assert proc.returncode == 0, self.log.read_text()[-3000:]
                continue
            hit = "random"
            if k % 2 == 0:  # mid-save: kill as soon as the temp of a save in progress appears
                hit = "missed save"
                while proc.poll() is None:
                    snapshot()
                    if mid_save():
                        hit = "mid-save"
                        break
            else:
                deadline = time.monotonic() + self.rng.uniform(0.0, 2.0)
                while proc.poll() is None and time.monotonic() < deadline:
                    snapshot()
                    time.sleep(0.002)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(60)
                done += 1
                self.outcomes.append(hit)
            else:
                self.outcomes.append("finished before kill")
            snapshot(force=True)
            _, alive = psutil.wait_procs(list(seen.values()), timeout=15)
            for p in alive:
                p.kill()
            assert not alive, f"kill {k} ({hit}) left processes behind: {[p.pid for p in alive]}"
            after_kill()
        proc = self._start()
        assert proc.wait(600) == 0, self.log.read_text()[-3000:]
        return done


def _tmp_exists(out: Path, pattern: str):
    def probe() -> bool:
        try:
            return any(e.name.startswith(pattern) for e in os.scandir(out))
        except FileNotFoundError:
            return False
    return probe


def _train_records(out: Path) -> list[int]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["kind"] == "train"]


def _report(tmp_path: Path, verb: str, killer: Killer, extra: str = "") -> None:
    line = f"{verb}: {len([o for o in killer.outcomes if o in ('mid-save', 'random')])} kills " \
           f"({', '.join(killer.outcomes)}){extra}"
    print(line)
    with open(Path(os.environ.get("GPTFORGE_FAULT_REPORT", tmp_path / "report.txt")), "a") as f:
        f.write(line + "\n")


def _config_file(root: Path, *over: str) -> Path:
    from gptforge.config import save_config

    cfg = train_config(root, "Engine.save_load.save_steps=2", "Engine.eval_freq=6", "Engine.eval_iters=1",
                       "Data.Train.loader.num_workers=1", *over, dropout=0.1, steps=STEPS)
    f = root / "run.yaml"
    save_config(cfg, f)
    return f


def _float_model(root: Path) -> Path:
    from gptforge.train import pretrain
    from test_train_support import small_tokenizer

    cfg = train_config(root / "float", "Model.num_attention_heads=8", "Engine.save_load.save_steps=-1",
                       "Engine.eval_freq=-1", steps=4)
    return pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False).checkpoint_dir


@pytest.mark.parametrize("verb", ["pretrain", "qat", "prune"])
def test_random_sigkills_then_resume_is_bit_exact(tmp_path, verb):
    rng = random.Random(f"{SEED}-{verb}")
    cfg_file = _config_file(tmp_path, *(["Model.num_attention_heads=8"] if verb != "pretrain" else []))
    extra: list[str] = []
    if verb == "qat":
        extra = ["-o", f"Compress.pretrained={_float_model(tmp_path)}"]
    elif verb == "prune":
        extra = ["-o", f"Compress.pretrained={_float_model(tmp_path)}", "-o", "Compress.Prune.enable=True",
                 "-o", "Compress.Prune.ratio=0.25"]

    def argv(out: Path) -> list[str]:
        return [verb, "-c", str(cfg_file), *extra, "-o", f"Engine.save_load.output_dir={out}", "--no-progress"]

    ref = tmp_path / "ref"
    assert subprocess.run([sys.executable, "-m", "gptforge", *argv(ref)], env=ENV, capture_output=True,
                          timeout=600).returncode == 0
    out = tmp_path / "killed"
    killer = Killer([*argv(out), "--resume", "auto"], out, rng, tmp_path / "killed.log")
    killer.run(KILLS, started=lambda: (out / "train.log").is_file(), mid_save=_tmp_exists(out, ".step_"),
               after_kill=lambda: _check_steps_complete(out))
    _check_steps_complete(out)
    final = f"step_{STEPS}"
    assert state_equal(_weights(ref / final), _weights(out / final)), "resumed run differs from the uninterrupted one"
    assert _train_records(out) == list(range(1, STEPS + 1))
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    _report(tmp_path, verb, killer, "; final weights bit-identical; one metrics record per step")


def test_random_sigkills_of_preprocess_then_rerun(tmp_path):
    rng = random.Random(f"{SEED}-preprocess")
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
    r = np.random.RandomState(0)
    with open(tmp_path / "in.jsonl", "w") as f:
        for _ in range(60000):
            f.write(json.dumps({"text": " ".join(r.choice(words, size=r.randint(20, 60)))}) + "\n")

    def argv(prefix: Path) -> list[str]:
        return ["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(prefix),
                "--workers", "2", "--no-progress"]

    assert subprocess.run([sys.executable, "-m", "gptforge", *argv(tmp_path / "ref" / "c")], env=ENV,
                          capture_output=True, timeout=600).returncode == 0
    out = tmp_path / "killed"

    def complete_looking() -> None:
        if (out / "c_idx.npz").exists():  # the last file renamed: the whole set must be there and agree
            from gptforge.data.indexed import load_token_files

            load_token_files(out / "c")

    killer = Killer(argv(out / "c"), out, rng, tmp_path / "killed.log")
    done = killer.run(KILLS, started=_tmp_exists(out, ".c_ids.npy."), mid_save=_tmp_exists(out, ".c_idx.npz."),
                      after_kill=complete_looking)
    for name in ("c_ids.npy", "c_idx.npz"):
        assert (out / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    _report(tmp_path, "preprocess", killer, f"; {done} killed; output byte-identical; no temp left")
