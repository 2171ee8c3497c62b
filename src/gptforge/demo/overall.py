"""The demo's bar on a terminal: time used of the budget and about how much is left.

The demo prints its stage lines on stderr (stdout keeps the result line); with the bar on, they
go through `tqdm.write`, so they scroll above the bar instead of tearing it. Redirected output has no bar: every stage line
already says the time used and left ("3:12 of 12:00, about 8:48 left").
"""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Callable

from gptforge import progress


def budget_text(elapsed: float, budget: float) -> str:
    """'3:12 of 12:00, about 8:48 left', or how far over the budget the demo is."""
    if elapsed <= budget:
        return f"{_mmss(elapsed)} of {_mmss(budget)}, about {_mmss(budget - elapsed)} left"
    return f"{_mmss(elapsed)}, over the {_mmss(budget)} budget by {_mmss(elapsed - budget)}"


def _mmss(seconds: float) -> str:
    m, sec = divmod(int(round(max(0.0, seconds))), 60)
    return f"{m}:{sec:02d}"


class _LinesAboveBar(io.TextIOBase):
    """A text stream that prints each complete line above the bar (`tqdm.write`)."""

    def __init__(self, real, write_line: Callable[[str], None]):
        self.real, self.write_line, self.buf = real, write_line, ""

    def write(self, s: str) -> int:
        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.write_line(line)
        return len(s)

    def flush(self) -> None:
        self.real.flush()

    def isatty(self) -> bool:
        return self.real.isatty()


class OverallBar:
    """A tqdm bar over the demo's budget, refreshed every second by a thread.

    `elapsed()` returns the demo's seconds so far (earlier runs of the same directory included).
    Use as a context manager; `console` is the stream the demo prints on while the bar shows.
    """

    def __init__(self, elapsed: Callable[[], float], budget_s: float, console=None, every: float = 1.0):
        from tqdm import tqdm

        self.elapsed, self.budget = elapsed, float(budget_s)
        self.real = console or sys.stderr
        self.every = every
        # The time text goes in `desc`: a custom bar_format prints it as it is ({postfix} would
        # add a leading ", ").
        self.bar = tqdm(total=int(self.budget), desc="", unit="s", file=sys.stderr, leave=False,
                        bar_format="demo {percentage:3.0f}%|{bar}| {desc}", **progress.tqdm_width())
        self.console = _LinesAboveBar(self.real, lambda line: tqdm.write(line, file=self.real))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gptforge-demo-bar", daemon=True)

    def refresh(self) -> None:
        el = self.elapsed()
        self.bar.n = int(min(el, self.budget))
        self.bar.set_description_str(budget_text(el, self.budget), refresh=False)
        self.bar.refresh()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.refresh()

    def __enter__(self) -> OverallBar:
        self.refresh()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.bar.close()


def wanted(echo: bool, console=None) -> bool:
    """The bar shows only on a terminal, with progress on (not --no-progress / --quiet)."""
    console = console or sys.stderr
    if not echo or progress.mode(sys.stderr) != "bar":
        return False
    try:
        return bool(console.isatty())
    except (AttributeError, ValueError):
        return False
