"""The demo's bar on a terminal: budget text, lines printed above the bar, and when it shows."""

from __future__ import annotations

import io
import re

from gptforge.demo import overall
from gptforge.demo.overall import OverallBar, budget_text, wanted


def test_budget_text_within_and_over_the_budget():
    assert budget_text(192, 720) == "3:12 of 12:00, about 8:48 left"
    assert budget_text(780, 720) == "13:00, over the 12:00 budget by 1:00"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_shows_time_left_and_lines_go_above_it(monkeypatch, capsys):
    monkeypatch.setenv("GPTFORGE_PROGRESS", "bar")
    console = _Tty()
    clock = {"t": 30.0}
    with OverallBar(lambda: clock["t"], 600, console, every=0.01) as bar:
        print("[ 1/15] learn a tokenizer ...", file=bar.console)
        bar.console.write("partial ")
        bar.console.write("line\n")
        clock["t"] = 90.0
        bar.refresh()
        assert bar.bar.n == 90
        assert bar.bar.desc == "1:30 of 10:00, about 8:30 left"
        clock["t"] = 700.0
        bar.refresh()
        assert bar.bar.n == 600  # the bar stops at the budget; the text says how far over
        assert bar.bar.desc == "11:40, over the 10:00 budget by 1:40"
    assert console.getvalue().splitlines() == ["[ 1/15] learn a tokenizer ...", "partial line"]
    err = capsys.readouterr().err
    assert re.search(r"demo +15%\|.*\| 1:30 of 10:00, about 8:30 left", err), repr(err)  # the bar, on stderr


def test_bar_only_on_a_terminal_with_progress_on(monkeypatch):
    monkeypatch.setenv("GPTFORGE_PROGRESS", "bar")
    assert wanted(True, _Tty())
    assert not wanted(False, _Tty())  # echo off (the tests' run_demo)
    assert not wanted(True, io.StringIO())  # stdout redirected: the stage lines carry the time left
    monkeypatch.setenv("GPTFORGE_PROGRESS", "off")  # --no-progress / --quiet
    assert not wanted(True, _Tty())
    monkeypatch.setenv("GPTFORGE_PROGRESS", "plain")
    assert not wanted(True, _Tty())
    assert overall.progress.mode() == "plain"
