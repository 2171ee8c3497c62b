"""gptforge.progress details beyond tests/test_cli_conventions.py: a bar on a terminal that
reports no width, and informational lines under --quiet."""

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
from pathlib import Path

import pytest

from gptforge import progress

ROOT = Path(__file__).resolve().parent.parent


def _read_all(fd: int, proc: subprocess.Popen) -> str:
    chunks = []
    while True:
        ready, _, _ = select.select([fd], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("cols", [0, 120])
def test_a_terminal_without_a_size_still_gets_a_bar(cols):
    """A bare pseudo-terminal reports 0 columns and 0 rows (`script` sets the columns only):
    tqdm's dynamic width would draw nothing there, and 0 rows hide the bar."""
    leader, follower = pty.openpty()  # no TIOCSWINSZ: 0 x 0
    if cols:
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 0, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in (progress.MODE_ENV, progress.QUIET_ENV, "COLUMNS")}
    env["PYTHONPATH"] = str(ROOT / "src")
    code = ("import time; from gptforge import progress\n"
            "for _ in progress.bar(range(3), desc='work', unit='step'): time.sleep(0.05)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=follower, stdout=subprocess.DEVNULL, env=env)
    os.close(follower)
    try:
        err = _read_all(leader, proc)
    finally:
        os.close(leader)
    assert proc.returncode == 0, err
    assert "\r" in err and re.search(r"work: +\d+%\|.*\| \d/3 \[\d\d:\d\d<", err), repr(err)  # bar with ETA


def test_informational_lines_obey_quiet(capsys, monkeypatch):
    monkeypatch.delenv(progress.QUIET_ENV, raising=False)
    progress.info("preparing")
    with progress.settings(quiet_=True):
        progress.info("hidden")
    assert capsys.readouterr().err == "preparing\n"
