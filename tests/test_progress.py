"""Progress reporting (gptforge.progress, docs/cli.md): a bar with an ETA on a terminal, plain
periodic lines when redirected, nothing with --no-progress, only the result with --quiet."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from gptforge import progress as prog

ROOT = Path(__file__).resolve().parent.parent
TQDM_ETA = re.compile(r"\d+/\d+ \[\d\d:\d\d<\d\d:\d\d")  # tqdm: "3/10 [00:01<00:02"
PLAIN_LINE = re.compile(r"^\[pretrain\] \d+% \d+/\d+ step (eta \d:\d\d:\d\d|in \d:\d\d:\d\d)", re.M)


# ------------------------------------------------------------------------------ the module


def test_mode_follows_the_environment(monkeypatch):
    for m in ("bar", "plain", "off"):
        monkeypatch.setenv(prog.ENV, m)
        assert prog.mode() == m
    monkeypatch.setenv(prog.ENV, "auto")
    assert prog.mode() == "plain"  # pytest captures stderr: not a terminal
    assert not prog.enabled(False)


def test_plain_lines_every_tenth_with_eta(monkeypatch, capsys):
    monkeypatch.setenv(prog.ENV, "plain")
    with prog.Progress(total=20, desc="export", unit="layer") as bar:
        for _ in range(20):
            bar.update(1)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 10, lines  # 10 %, 20 %, ... 90 %, and the closing line
    assert lines[0].startswith("[export] 10% 2/20 layer eta 0:00:0"), lines[0]
    assert lines[-1].startswith("[export] 100% 20/20 layer in 0:00:0"), lines[-1]
    assert "\r" not in err and "\x1b[" not in err


def test_plain_lines_also_every_interval(monkeypatch, capsys):
    monkeypatch.setenv(prog.ENV, "plain")
    monkeypatch.setattr(prog, "INTERVAL_S", 0.05)
    bar = prog.Progress(total=1000, desc="x")
    bar.update(1)
    time.sleep(0.06)
    bar.update(1)  # 0.2 % of the work, but past the interval
    assert capsys.readouterr().err.startswith("[x] 0% 2/1000 it eta ")


def test_off_and_quiet_print_nothing(monkeypatch, capsys):
    monkeypatch.setenv(prog.ENV, "off")
    monkeypatch.setenv(prog.QUIET_ENV, "1")
    for _ in prog.track(range(5), desc="x"):
        pass
    with prog.task("export", "writing"):
        pass
    prog.info("hello")
    assert capsys.readouterr().err == ""


def test_task_lines_name_the_elapsed_time(monkeypatch, capsys):
    monkeypatch.setenv(prog.ENV, "plain")
    with prog.task("export", "writing ONNX"):
        pass
    assert re.fullmatch(r"\[export\] writing ONNX \.\.\.\n\[export\] writing ONNX \.\.\. done in \d+\.\d s\n",
                        capsys.readouterr().err)


def test_configure_restores_the_environment(monkeypatch):
    monkeypatch.delenv(prog.ENV, raising=False)
    with prog.configure(no_progress=False, quiet_=True):
        assert prog.mode() == "off" and prog.quiet()
    assert prog.ENV not in os.environ and not prog.quiet()


# ------------------------------------------------------------------------------ a verb end to end


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from gptforge.config import save_config
    from test_train_support import small_tokenizer, train_config

    root = tmp_path_factory.mktemp("progress")
    cfg = train_config(root, "Engine.save_load.save_steps=-1", "Engine.eval_freq=100", "Engine.logging_freq=5",
                       steps=10)
    small_tokenizer().save(root / "tok")
    save_config(cfg, root / "run.yaml")
    return root


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPTFORGE_PROGRESS") and k != prog.QUIET_ENV}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", COLUMNS="100")
    return env


def _argv(run: Path, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gptforge", "pretrain", "-c", str(run / "run.yaml"), "--out", str(run / out), *extra]


def _redirected(run: Path, out: str, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(_argv(run, out, *extra), capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_redirected_gets_plain_periodic_lines(run):
    err = _redirected(run, "plain").stderr
    assert "\r" not in err and "\x1b[" not in err, err
    assert len(PLAIN_LINE.findall(err)) >= 5, err  # one at every 10 % of the 10 steps


def test_terminal_gets_a_bar_with_an_eta(run):
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # a terminal has a size
    proc = subprocess.Popen(_argv(run, "tty"), stdout=subprocess.DEVNULL, stderr=child, env=_env())
    os.close(child)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([main], [], [], 600)
            if not ready:
                break
            try:
                data = os.read(main, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        proc.wait(timeout=600)
        os.close(main)
    err = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, err
    assert "\r" in err and TQDM_ETA.search(err), err
    assert not PLAIN_LINE.search(err), err


def test_no_progress_shows_neither(run):
    proc = _redirected(run, "none", "--no-progress")
    assert not PLAIN_LINE.search(proc.stderr) and "\r" not in proc.stderr, proc.stderr
    assert "[pretrain]" not in proc.stderr
    assert "[train] epoch" in proc.stdout  # informational log lines remain (--quiet drops those)


def test_quiet_prints_only_the_result(run):
    proc = _redirected(run, "quiet", "--quiet")
    assert proc.stdout.strip().splitlines() == [proc.stdout.strip()], proc.stdout  # one line
    assert proc.stdout.startswith("gptforge pretrain: done at step 10"), proc.stdout
    assert proc.stderr == "", proc.stderr
