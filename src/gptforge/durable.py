"""Durable publication: fsync before the rename that publishes, and replacing a directory
without a moment in which no complete copy exists.

`publish_dir(tmp, out)` fsyncs every file and directory under `tmp`, then renames it to `out`
and fsyncs the parent, so a published output survives a power loss. An existing `out` is
swapped with `tmp` in one `renameat2(RENAME_EXCHANGE)` call (Linux) and the old copy, now under
the temp name, is deleted afterwards. Where the exchange is unavailable, the old copy is first
renamed aside to `.<name>.old-<pid>`; `recover_aside(out)` (run before the next write) renames
it back if the writer died before the new copy was in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
from pathlib import Path

from gptforge.run_lock import path_writer_alive

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = None


def fsync_path(path: str | os.PathLike) -> None:
    """fsync one file or directory (directories: their entries)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under `root` (files first, then their directories)."""
    for d, _, files in os.walk(root, topdown=False):
        for f in files:
            fsync_path(os.path.join(d, f))
        fsync_path(d)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the system cannot."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        fn = _libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EXDEV, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_dir(tmp: str | os.PathLike, out: str | os.PathLike) -> None:
    """Make the finished directory `tmp` appear as `out`, durably; an existing `out` is replaced
    so that `out` always names one complete copy (the old or the new)."""
    tmp, out = Path(tmp), Path(out)
    fsync_tree(tmp)
    if out.exists() and _exchange(tmp, out):
        fsync_path(out.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # the old copy now lives under the temp name
        return
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_ASIDE = re.compile(r"^\.(?P<name>.+)\.old-(?P<pid>\d+)$")


def recover_aside(parent: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Undo replacements a killed writer left half done in `parent` (only `name` when given):
    an aside copy whose target is missing is renamed back; one whose target exists is removed.
    Copies of a writer that still runs are left alone. Returns the paths restored."""
    restored = []
    d = Path(parent)
    if not d.is_dir():
        return restored
    for c in d.iterdir():
        m = _ASIDE.match(c.name)
        if not m or (name is not None and m.group("name") != name):
            continue
        if path_writer_alive(int(m.group("pid")), c):
            continue
        target = d / m.group("name")
        if target.exists():
            if c.is_dir():
                shutil.rmtree(c, ignore_errors=True)
            else:
                c.unlink(missing_ok=True)
        else:
            os.replace(c, target)
            restored.append(target)
    if restored:
        fsync_path(d)
    return restored


def write_text_durable(path: str | os.PathLike, text: str) -> Path:
    """Write a small text file by temp name + fsync + rename (the temp carries the writer's pid)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    fsync_path(p.parent)
    return p


__all__ = ["fsync_path", "fsync_tree", "publish_dir", "recover_aside", "write_text_durable"]
