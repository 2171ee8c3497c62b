"""Progress of long work, the same way in every verb.

- on a terminal: a tqdm bar with an ETA on stderr;
- output redirected (a log file, CI, a pipe): plain lines on stderr every `GPTFORGE_PROGRESS_EVERY`
  seconds (default 10) and at the end, with no carriage returns or colour codes;
- `--no-progress` or `--quiet` (any verb): nothing.

The choice travels in the environment (`GPTFORGE_PROGRESS=auto|bar|plain|off`), so stages deep
below the command line and worker processes follow it without an argument threaded through;
`gptforge.cli` sets it for the duration of a verb. `GPTFORGE_QUIET=1` (set by `--quiet`) also
silences informational lines such as the trainer's periodic log on the console.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator

MODE_ENV = "GPTFORGE_PROGRESS"
QUIET_ENV = "GPTFORGE_QUIET"
EVERY_ENV = "GPTFORGE_PROGRESS_EVERY"
MODES = ("auto", "bar", "plain", "off")


def mode(stream=None) -> str:
    """'bar', 'plain' or 'off' for `stream` (default stderr)."""
    m = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if m not in MODES:
        m = "auto"
    if m != "auto":
        return m
    stream = sys.stderr if stream is None else stream
    try:
        return "bar" if stream.isatty() else "plain"
    except (AttributeError, ValueError):  # a closed or unusual stream
        return "plain"


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


@contextlib.contextmanager
def settings(no_progress: bool = False, quiet_: bool = False) -> Iterator[None]:
    """Set the mode for the duration of a verb (restored after: `cli.main` may run many verbs in
    one process, as the demo and the tests do)."""
    saved = {k: os.environ.get(k) for k in (MODE_ENV, QUIET_ENV)}
    if no_progress or quiet_:
        os.environ[MODE_ENV] = "off"
    if quiet_:
        os.environ[QUIET_ENV] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


class _Null:
    """The bar when progress is off: every method does nothing."""

    n = 0

    def __init__(self, iterable=None):
        self._it = iterable

    def __iter__(self):
        return iter(self._it if self._it is not None else ())

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = False) -> None:
        pass

    def set_postfix(self, *a, **k) -> None:
        pass

    def write(self, line: str, file=None) -> None:
        print(line, file=file or sys.stdout, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Plain(_Null):
    """Periodic plain lines: `[desc] 40% 12/30 batch, 0:00:05 elapsed, eta 0:00:08`."""

    def __init__(self, iterable=None, total=None, desc="", unit="it", initial=0, unit_scale=False, stream=None):
        super().__init__(iterable)
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.desc, self.unit, self.unit_scale = total, desc or "progress", unit, unit_scale
        self.n = self._start = initial
        self.stream = stream or sys.stderr
        self.t0 = self._last = time.monotonic()
        self.every = float(os.environ.get(EVERY_ENV, "10") or 10)
        self.postfix = ""
        self._closed = False

    def __iter__(self):
        for x in super().__iter__():
            yield x
            self.update(1)
        self.close()

    def _count(self, n: float) -> str:
        if self.unit_scale:
            for suffix in ("", "k", "M", "G", "T"):
                if abs(n) < 1000 or suffix == "T":
                    return f"{n:.0f}{suffix}" if suffix == "" else f"{n:.1f}{suffix}"
                n /= 1000
        return f"{n:g}" if isinstance(n, float) else str(n)

    def _line(self, final: bool = False) -> str:
        el = time.monotonic() - self.t0
        done = self.n - self._start
        if final:
            head = f"[{self.desc}] done: {self._count(self.n)} {self.unit} in {_hms(el)}"
        elif self.total:
            pct = 100.0 * self.n / self.total
            eta = el / done * (self.total - self.n) if done > 0 else None
            head = (f"[{self.desc}] {pct:3.0f}% {self._count(self.n)}/{self._count(self.total)} {self.unit}, "
                    f"{_hms(el)} elapsed, eta {_hms(eta) if eta is not None else '?'}")
        else:
            head = f"[{self.desc}] {self._count(self.n)} {self.unit}, {_hms(el)} elapsed"
        return head + (f" ({self.postfix})" if self.postfix and not final else "")

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            print(self._line(), file=self.stream, flush=True)

    def set_postfix_str(self, s: str = "", refresh: bool = False) -> None:
        self.postfix = s

    def set_postfix(self, *a, **k) -> None:
        self.postfix = ", ".join(f"{key}={v}" for key, v in k.items() if key != "refresh")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._last != self.t0:  # work short enough to print no periodic line ends silently too
                print(self._line(final=True), file=self.stream, flush=True)


def bar(iterable: Iterable | None = None, total: int | float | None = None, desc: str = "", unit: str = "it",
        initial: int = 0, enabled: bool = True, unit_scale: bool = False, leave: bool = False):
    """A progress bar in the current mode (tqdm-like: iterate it, or `update(n)` and `close()`)."""
    m = mode() if enabled else "off"
    if m == "off":
        return _Null(iterable)
    if m == "plain":
        return _Plain(iterable, total=total, desc=desc, unit=unit, initial=initial, unit_scale=unit_scale)
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, unit_scale=unit_scale,
                file=sys.stderr, leave=leave, **tqdm_width())


def tqdm_width() -> dict:
    """tqdm's size arguments for a bar on stderr. A terminal that reports no width or no height
    (a bare pseudo-terminal, some container consoles) would get an empty or a hidden bar: it gets
    a fixed size in what it does not report."""
    cols, rows = _size(sys.stderr)
    if cols > 0 and rows > 0:
        return {"dynamic_ncols": True}
    # Fixed: tqdm's dynamic size would re-read the 0 and hide the bar (it hides a bar at a row
    # >= rows - 1, and takes 0 rows as -1).
    return {"ncols": cols if cols > 0 else 100, "nrows": 20}


def _size(stream) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(stream.fileno())
        return size.columns, size.lines
    except (AttributeError, ValueError, OSError):
        return 0, 0


def info(line: str, file=None) -> None:
    """An informational line (stderr by default); `--quiet` drops it."""
    if not quiet():
        print(line, file=file or sys.stderr, flush=True)


@contextlib.contextmanager
def task(desc: str, enabled: bool = True, after: float = 2.0) -> Iterator[None]:
    """Work without a count (an ONNX export, a conversion). Once it has run `after` seconds, a
    line says what is running, then one every `GPTFORGE_PROGRESS_EVERY` seconds with the time
    so far, and a last one with the time it took. Work that ends (or fails) sooner prints
    nothing, so a quick error stays the one line it is. Nothing when progress is off."""
    if not enabled or mode() == "off":
        yield
        return
    import threading

    t0 = time.monotonic()
    every = float(os.environ.get(EVERY_ENV, "10") or 10)
    stop = threading.Event()
    spoke = threading.Event()

    def watch() -> None:
        if stop.wait(after):
            return
        spoke.set()
        print(f"[{desc}] ...", file=sys.stderr, flush=True)
        while not stop.wait(max(every, 0.5)):
            print(f"[{desc}] {_hms(time.monotonic() - t0)} elapsed", file=sys.stderr, flush=True)

    thread = threading.Thread(target=watch, name="gptforge-progress", daemon=True)
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        thread.join()
        if ok and spoke.is_set():
            print(f"[{desc}] done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
