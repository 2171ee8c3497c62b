"""The built-in corpus: text every machine with Python already has, found at run time.

Documents come from the running interpreter's standard library, in a fixed order:
- prose: the language-reference topics that `help()` shows (`pydoc_data.topics`) and every
  distinct docstring of every module, class and function (read with `ast`, nothing imported);
- code: the source of every module (tests and site-packages excluded).
The list is shuffled with a fixed seed (the reference shuffles its jsonl too) so that the
Train/Eval/Test document ranges of a split all mix prose and code. About 14 MB of text
(≈ 3.5 M GPT-2 tokens) for CPython 3.11; the exact figure depends on the Python version.
Nothing is copied into the repository.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gptforge.errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    from gptforge.data.tokenizer import Tokenizer

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "lib-dynload"}
SHUFFLE_SEED = 1234
MIN_DOCSTRING = 40  # shorter docstrings ("Return x.") teach little and would be most documents


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory (the base install, not a venv)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").is_file():
        raise DataError(f"{root}: the Python standard library's source is not installed here; "
                        "give your own text with --input")
    return root


def source_files(root: Path | None = None) -> list[Path]:
    """Every stdlib .py file in sorted order, without tests and third-party packages."""
    root = root or stdlib_root()
    out: list[Path] = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("config-"))
        out.extend(Path(d) / f for f in sorted(files) if f.endswith(".py"))
    return out


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _docstrings(source: str) -> Iterator[str]:
    with warnings.catch_warnings():  # old escape sequences in a few modules
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def _topics() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [topics[k].strip() for k in sorted(topics)]


def builtin_documents(parts: tuple[str, ...] = ("prose", "code")) -> list[str]:
    """The built-in corpus as a list of documents (deterministic for a given Python install)."""
    return list(_extract(tuple(parts)))


@functools.lru_cache(maxsize=2)  # parsing the stdlib takes seconds; a process needs it once
def _extract(parts: tuple[str, ...]) -> tuple[str, ...]:
    root = stdlib_root()
    files = source_files(root)
    docs: list[str] = []
    sources = [_read(f) for f in files]
    if "prose" in parts:
        docs.extend(_topics())
        seen: set[str] = set()
        for src in sources:
            for doc in _docstrings(src):
                if len(doc) >= MIN_DOCSTRING and doc not in seen:
                    seen.add(doc)
                    docs.append(doc)
    if "code" in parts:
        docs.extend(src for src in sources if src.strip())
    order = np.random.RandomState(SHUFFLE_SEED).permutation(len(docs))
    return tuple(docs[i] for i in order)


def corpus_fingerprint() -> str:
    """Identifies this interpreter's corpus (version + file names and sizes), for caching."""
    root = stdlib_root()
    h = hashlib.sha1(sys.version.encode())
    for f in source_files(root):
        h.update(f"{f.relative_to(root)}:{f.stat().st_size}\n".encode())
    return h.hexdigest()[:12]


def builtin_token_files(tokenizer: Tokenizer, cache: str | os.PathLike | None = None) -> Path:
    """Prefix of the built-in corpus tokenized with `tokenizer`, prepared once into the cache.

    The cache is `$GPTFORGE_CACHE` (else ~/.cache/gptforge)/builtin/<python+corpus>-<tokenizer>/.
    Files are written under temporary names and renamed, `_idx.npz` last, so readers never see
    half a corpus; two processes that race take turns (the prefix lock) and the second finds it ready.
    """
    from gptforge.data.index_map import cache_root
    from gptforge.data.indexed import IDX_SUFFIX, load_token_files
    from gptforge.data.preprocess import preprocess_documents

    base = Path(cache) if cache is not None else cache_root()
    v = sys.version_info
    out_dir = base / "builtin" / f"py{v.major}.{v.minor}.{v.micro}-{corpus_fingerprint()}-{tokenizer.fingerprint()}"
    prefix = out_dir / "builtin"

    def cached() -> bool:
        if Path(str(prefix) + IDX_SUFFIX).is_file():
            try:
                load_token_files(prefix)
                return True
            except DataError:
                pass  # damaged: rebuild below
        return False

    if cached():
        return prefix
    from gptforge.run_lock import lock_prefix

    with lock_prefix(prefix, "preprocess", wait=True):  # a racing process prepares it once; the other waits
        if cached():
            return prefix
        from gptforge.progress import info, task

        info(f"gptforge: preparing the built-in corpus (Python {v.major}.{v.minor} standard library) "
             f"with tokenizer {tokenizer.name!r} into {out_dir} (once; later runs reuse it)")
        with task("corpus: reading the standard library"):
            docs = builtin_documents()
        preprocess_documents(docs, prefix, tokenizer, append_eos=True,
                             source=f"builtin: Python {sys.version.split()[0]} standard library")
    return prefix
