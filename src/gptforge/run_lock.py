"""One writer per output directory: an advisory `fcntl.flock` lock, and whether a writer still lives.

Every verb that writes a run directory takes `lock_dir(out, verb)` (lock file `out/.gptforge.lock`);
`preprocess` takes `lock_prefix(prefix, verb)` (`.<name>.lock` next to its token files). A second
writer fails at once with a `UsageError` naming the holder's pid, verb, host and start time.
flock locks die with their process, so the lock of a killed writer is simply taken over; the
file itself is removed on a clean release and harmless when left by a killed one.

The lock is re-entrant within one process (a `Trainer` inside `prune` takes the lock `prune`
already holds), so it only ever stops *another* process.

`writer_alive(pid, since)` tells whether the process that wrote a temp file (its pid is in the
name) is still running; a pid reused by a process started after the temp was last written, or a
zombie, counts as dead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from gptforge.errors import UsageError

LOCK_NAME = ".gptforge.lock"

_held: dict[str, list] = {}  # lock path -> [fd, count]: re-entrant within this process


class RunLock:
    """A held lock on `path`; `release()` (or leaving a `with` block) gives it back."""

    def __init__(self, path: Path, what: Path, verb: str):
        self.path, self.what, self.verb = path, what, verb
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        entry = _held.get(str(self.path))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[str(self.path)]
        fd = entry[0]
        # Unlink while still holding the lock: a writer that opened the old file re-checks the
        # inode after locking (see _acquire) and retries on the new one.
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:  # a Trainer that is never trained still gives its lock back
        with contextlib.suppress(Exception):
            self.release()


def read_holder(lock_file: str | os.PathLike) -> dict:
    """What the lock file says about its holder (empty when unreadable)."""
    try:
        return json.loads(Path(lock_file).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}


def _describe(info: dict) -> str:
    if not info.get("pid"):
        return "another process"
    return (f"pid {info['pid']} ({info.get('verb', '?')} on {info.get('host', '?')}, "
            f"since {info.get('started', '?')})")


def _acquire(lock_file: Path, what: Path, verb: str, wait: bool = False) -> RunLock:
    key = str(lock_file)
    if key in _held:
        _held[key][1] += 1
        return RunLock(lock_file, what, verb)
    for _ in range(20):  # retries only when a releasing holder unlinked the file under us
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"{what}: in use by {_describe(read_holder(lock_file))}; wait for it to finish "
                             "or choose another output") from None
        except OSError as e:  # a filesystem without flock support: no lock, as before
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP):
                return RunLock(lock_file, what, verb)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_file).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        info = {"pid": os.getpid(), "host": socket.gethostname(), "verb": verb,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        _held[key] = [fd, 1]
        return RunLock(lock_file, what, verb)
    raise UsageError(f"{what}: could not take the lock {lock_file}; another process keeps replacing it")


def lock_dir(directory: str | os.PathLike, verb: str) -> RunLock:
    """Lock the output directory `directory` (created if missing) for `verb`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    return _acquire(d / LOCK_NAME, d, verb)


def lock_prefix(prefix: str | os.PathLike, verb: str, wait: bool = False) -> RunLock:
    """Lock the files `<prefix>_*` (the lock file `.<name>.lock` lives next to them); `wait`
    blocks until the holder is done instead of failing (for caches that several runs share)."""
    p = Path(prefix)
    p.parent.mkdir(parents=True, exist_ok=True)
    return _acquire(p.parent / f".{p.name}.lock", p, verb, wait)


def lock_output(path: str | os.PathLike, verb: str) -> RunLock:
    """Lock an output directory that is published whole by an atomic rename (export, quantize,
    convert, ptq): the lock file must live beside it, since the directory itself is replaced."""
    return lock_prefix(path, verb)


# ------------------------------------------------------------------------------ liveness


def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def _proc_start(pid: int) -> tuple[str, float | None] | None:
    """(state letter, start time as a Unix time) from /proc, or None where /proc has no such pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return ("?", None)
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
    boot = _boot_time()
    start = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK") if boot is not None else None
    return fields[0], start


def writer_alive(pid: int, since: float | None = None) -> bool:
    """Whether process `pid` still runs and could have written a file last modified at `since`."""
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    if Path("/proc/self/stat").exists():
        info = _proc_start(pid)
        if info is None:
            return False
        state, start = info
        if state in ("Z", "X"):
            return False
        # started after the file was last written: a reused pid, not the writer (2 s slack for clock ticks)
        return not (since is not None and start is not None and start > since + 2.0)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def path_writer_alive(pid: int | None, path: str | os.PathLike) -> bool:
    """`writer_alive` for the temp `path` whose name carries `pid` (None: a name without one)."""
    if pid is None:
        return False
    try:
        since = os.stat(path).st_mtime
    except OSError:
        since = None
    return writer_alive(pid, since)


__all__ = ["LOCK_NAME", "RunLock", "lock_dir", "lock_output", "lock_prefix", "path_writer_alive", "read_holder", "writer_alive"]
