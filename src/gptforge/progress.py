"""Progress reporting for every long stage: one decision, three renderings.

The mode comes from `GPTFORGE_PROGRESS` (set by the CLI from `--no-progress`/`--quiet`, so
stages deep below need no extra argument):

- ``bar``: a tqdm bar with an ETA on stderr;
- ``plain``: periodic lines on stderr (``[export] 40% 12/30 eta 0:00:14``) every ~10 s or
  10 % of the work, with no carriage returns or ANSI codes, fit for a redirected log;
- ``off``: nothing;
- ``auto`` (default): ``bar`` when stderr is a terminal, else ``plain``.

`GPTFORGE_QUIET=1` (`--quiet`) also silences `info()` lines: only errors and the final result
are printed. A stage's own `progress=False` turns its progress off whatever the mode.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator

ENV = "GPTFORGE_PROGRESS"
QUIET_ENV = "GPTFORGE_QUIET"
MODES = ("auto", "bar", "plain", "off")
INTERVAL_S = 10.0  # plain mode: a line at least this often while work advances...
STEP_FRACTION = 0.1  # ...and at every 10 % of the total


def mode() -> str:
    """The effective mode: ``bar``, ``plain`` or ``off`` (an unknown value counts as ``auto``)."""
    m = os.environ.get(ENV, "auto").strip().lower()
    if m not in MODES or m == "auto":
        return "bar" if _isatty(sys.stderr) else "plain"
    return m


def quiet() -> bool:
    """Whether informational lines are suppressed (`--quiet`)."""
    return os.environ.get(QUIET_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def enabled(progress: bool | None = None) -> bool:
    """Whether a stage called with `progress` (None: the mode decides) shows progress."""
    return progress is not False and mode() != "off"


@contextlib.contextmanager
def configure(no_progress: bool = False, quiet_: bool = False) -> Iterator[None]:
    """While in the block, the choice of the CLI flags holds for this process and its children
    (restored afterwards, for a caller that runs several commands in one process)."""
    saved = {k: os.environ.get(k) for k in (ENV, QUIET_ENV)}
    if quiet_:
        os.environ[QUIET_ENV] = "1"
    if no_progress or quiet_:
        os.environ[ENV] = "off"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def info(line: str, file=None) -> None:
    """An informational line (stderr by default), suppressed by `--quiet`."""
    if not quiet():
        print(line, file=file or sys.stderr, flush=True)


def _isatty(f) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):
        return False


def _columns(f) -> int:
    try:
        return os.get_terminal_size(f.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def _clock(seconds: float) -> str:
    s = int(max(seconds, 0) + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """A counter that renders as the mode says; the tqdm calls the stages use (`update`,
    `set_postfix`, `set_postfix_str`, `write`, `close`, `n`, context manager)."""

    def __init__(self, total: float | None = None, desc: str = "", unit: str = "it", initial: float = 0,
                 progress: bool | None = None, leave: bool = True, unit_scale: bool = False):
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = initial
        self._start_n = initial
        self._postfix = ""
        self._bar = None
        self._closed = False
        self.mode = mode() if enabled(progress) else "off"
        self._t0 = self._last_t = time.monotonic()
        self._last_frac = initial / total if total else 0.0
        if self.mode == "bar":
            from tqdm import tqdm

            # a terminal that reports no width (a bare pty) would get an empty bar from tqdm
            sized = _columns(sys.stderr) > 0
            self._bar = tqdm(total=total, desc=desc, unit=unit, initial=initial, file=sys.stderr,
                             dynamic_ncols=sized, ncols=None if sized else 100, leave=leave, unit_scale=unit_scale)

    # -- tqdm-like API
    def update(self, n: float = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "plain":
            now = time.monotonic()
            frac = self.n / self.total if self.total else 0.0
            if self.total and self.n >= self.total:
                return  # the closing line reports the end
            if now - self._last_t >= INTERVAL_S or (self.total and frac - self._last_frac >= STEP_FRACTION - 1e-9):
                self._line(now)
                self._last_t, self._last_frac = now, frac

    def set_postfix(self, refresh: bool = False, **kw) -> None:
        self.set_postfix_str(", ".join(f"{k}={v}" for k, v in kw.items()), refresh=refresh)

    def set_postfix_str(self, s: str = "", refresh: bool = False) -> None:
        self._postfix = s
        if self._bar is not None:
            self._bar.set_postfix_str(s, refresh=refresh)

    def write(self, line: str, file=None) -> None:
        """Print a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(line, file=file or sys.stdout)
        else:
            print(line, file=file or sys.stdout, flush=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "plain" and self.n != self._start_n:
            self._line(time.monotonic(), final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plain rendering
    def _line(self, now: float, final: bool = False) -> None:
        elapsed = now - self._t0
        count = _count(self.n, self.unit)
        if self.total:
            pct = f"{100 * self.n / self.total:.0f}% {_count(self.n, '')}/{_count(self.total, self.unit)}"
            done = self.n - self._start_n
            if final:
                tail = f"in {_clock(elapsed)}"
            elif done > 0:
                tail = f"eta {_clock(elapsed / done * (self.total - self.n))}"
            else:
                tail = "eta ?"
            text = f"{pct} {tail}"
        else:
            text = f"{count} in {_clock(elapsed)}"
        post = f" ({self._postfix})" if self._postfix else ""
        print(f"[{self.desc}] {text}{post}", file=sys.stderr, flush=True)


def _count(n: float, unit: str) -> str:
    num = f"{n:g}" if isinstance(n, float) and not float(n).is_integer() else f"{int(n)}"
    return f"{num} {unit}".rstrip()


def track(iterable: Iterable, total: int | None = None, desc: str = "", unit: str = "it",
          progress: bool | None = None, leave: bool = True) -> Iterator:
    """Iterate `iterable`, counting each item."""
    if total is None:
        with contextlib.suppress(TypeError):
            total = len(iterable)  # type: ignore[arg-type]
    with Progress(total=total, desc=desc, unit=unit, progress=progress, leave=leave) as bar:
        for item in iterable:
            yield item
            bar.update(1)


@contextlib.contextmanager
def task(desc: str, what: str, progress: bool | None = None) -> Iterator[None]:
    """Work with no natural count: ``[desc] what ...`` at the start and ``... done in 25.1 s`` at
    the end (the same lines on a terminal and in a log)."""
    show = enabled(progress)
    if show:
        print(f"[{desc}] {what} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    yield
    if show:
        print(f"[{desc}] {what} ... done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
