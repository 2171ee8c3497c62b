"""File-system faults in the user's terms: a full disk, and a path of the wrong kind.

A full disk reaches us in many shapes: `OSError` with ENOSPC/EDQUOT/EFBIG from Python writes,
`OSError("N requested and M written")` (no errno) from numpy, a plain `Exception("No space left
on device (os error 28)")` from the Rust `tokenizers`/`safetensors` writers, and torch.save's
`RuntimeError("... unexpected pos N vs M")`. `disk_full_guard(path)` turns all of them into one
`DiskFullError` line naming the path and the free space; callers remove their temporaries.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from gptforge.errors import DataError, DiskFullError, GPTForgeError

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
SHORT_WRITE = 0  # a writer that reports only "wrote fewer bytes than asked" (numpy, torch.save)

# Messages of writers that lose the errno (Rust io::Error text, numpy, torch's stream writer).
_DISK_FULL_TEXT = re.compile(
    r"no space left on device|disk quota exceeded|file too large|os error (?:28|122|27)\b"
    r"|StorageFull|FileTooLarge|QuotaExceeded"
    r"|\d+ requested and \d+ written"  # numpy's short write
    r"|unexpected pos \d+ vs \d+|PytorchStreamWriter failed writing",  # torch.save's short write
    re.IGNORECASE,
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def disk_full_errno(exc: BaseException) -> int | None:
    """ENOSPC, EDQUOT, EFBIG (or SHORT_WRITE when the writer does not say which) when `exc`
    (or what caused it) is a full disk; None otherwise."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e.errno
        text = str(e)
        m = _DISK_FULL_TEXT.search(text)
        if m:
            low = m.group(0).lower()
            if low in ("file too large", "os error 27", "filetoolarge"):
                return errno.EFBIG
            if low in ("disk quota exceeded", "os error 122", "quotaexceeded"):
                return errno.EDQUOT
            if "no space" in low or low in ("os error 28", "storagefull"):
                return errno.ENOSPC
            return SHORT_WRITE
    return None


def free_space(path: str | os.PathLike) -> str:
    """'1.2 GB free' on the file system holding `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return "unknown free space"
    size = float(free)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit} free" if unit == "B" else f"{size:.1f} {unit} free"
        size /= 1000
    return f"{free} B free"  # pragma: no cover


_REASONS = {
    SHORT_WRITE: "a write came up short: no space left on device, a disk quota or the file-size limit",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for the file system or the file-size limit (ulimit -f)",
}


def disk_full_error(path: str | os.PathLike, code: int = errno.ENOSPC, atomic: bool = True) -> DiskFullError:
    """The one-line error for a write to `path` that ran out of disk space. `atomic` (the
    writers that publish by rename) adds that nothing was published and earlier outputs are intact."""
    tail = " (nothing was published; earlier outputs are untouched)" if atomic else ""
    return DiskFullError(
        f"{path}: disk full while writing ({_REASONS.get(code) or os.strerror(code)}; {free_space(path)} "
        f"on that file system); free some space or write elsewhere, then run again{tail}"
    )


@contextlib.contextmanager
def disk_full_guard(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise a full-disk failure inside the block as a `DiskFullError` naming `path`."""
    try:
        yield
    except GPTForgeError:
        raise
    except Exception as e:
        code = disk_full_errno(e)
        if code is None:
            raise
        raise disk_full_error(path, code) from None


# --------------------------------------------------------------------------- path kinds


def check_path_kind(path: str | os.PathLike, kind: str, what: str, error: type[GPTForgeError] = DataError,
                    hint: str = "") -> Path:
    """`path` as a Path when it exists and is a `kind` ('file' or 'dir'); otherwise `error`
    with one line: "WHAT PATH: not found" / "is a directory, expected a file" / "is a file,
    expected a directory"."""
    if kind not in ("file", "dir"):
        raise ValueError(kind)
    p = Path(path)
    label = f"{what} {p}" if what else str(p)
    tail = f"; {hint}" if hint else ""
    if not p.exists():
        raise error(f"{label}: not found{tail}")
    if kind == "file" and p.is_dir():
        raise error(f"{label}: is a directory, expected a file{tail}")
    if kind == "dir" and not p.is_dir():
        raise error(f"{label}: is a file, expected a directory{tail}")
    if kind == "file" and not p.is_file():
        raise error(f"{label}: is not a regular file{tail}")
    return p
