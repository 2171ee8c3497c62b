"""Preprocess inputs: file, directory and glob arguments, and the readers that cut them into
~1 MB `Chunk`s of documents (jsonl lines, blank-line separated text, optionally .zst, or strings)."""

from __future__ import annotations

import contextlib
import glob
import io
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gptforge.errors import DataError

CHUNK_BYTES = 1 << 20
JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.zst", ".json.zst")  # any other named file is text
# What a directory contributes (.json left out: metadata files such as our own _meta.json live there).
DIR_SUFFIXES = (".jsonl", ".jsonl.zst", ".txt", ".text", ".md", ".rst", ".txt.zst")


@dataclass
class Chunk:
    kind: str  # text | jsonl | docs
    where: str
    first_line: int
    items: list  # raw bytes documents / raw jsonl lines / str documents
    nbytes: int



def _is_jsonl(path: Path) -> bool:
    return path.name.lower().endswith(JSONL_SUFFIXES)


def expand_inputs(specs: Iterable[str | os.PathLike]) -> list[Path]:
    """Files named by files, directories (searched recursively) and glob patterns, sorted."""
    out: list[Path] = []
    for spec in specs:
        text = os.path.expanduser(os.fspath(spec))
        p = Path(text)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.lower().endswith(DIR_SUFFIXES))
            if not found:
                raise DataError(f"{p}: no .txt/.jsonl/.jsonl.zst files in this directory")
            out.extend(found)
        else:
            found = sorted(Path(f) for f in glob.glob(text, recursive=True) if Path(f).is_file())
            if not found:
                raise DataError(f"{text}: no such file, directory or matching files")
            out.extend(found)
    if not out:
        raise DataError("no input: give --input FILE/DIR/GLOB or --builtin")
    return out


@contextlib.contextmanager
def _open_binary(path: Path):
    if path.name.lower().endswith(".zst"):
        import zstandard

        with open(path, "rb") as raw:
            reader = zstandard.ZstdDecompressor().stream_reader(raw)
            yield io.BufferedReader(reader, buffer_size=1 << 20)
    else:
        with open(path, "rb") as f:
            yield f


def file_chunks(path: Path) -> Iterator[Chunk]:
    """Chunks of one file: jsonl lines, or blank-line separated text documents (newlines kept)."""
    jsonl = _is_jsonl(path)
    items: list = []
    size = 0
    first = 1
    doc: list[bytes] = []
    doc_line = 1
    try:
        with _open_binary(path) as f:
            for lineno, line in enumerate(f, 1):
                size += len(line)
                if jsonl:
                    items.append(line)
                elif line.strip():
                    if not doc:
                        doc_line = lineno
                    doc.append(line)
                elif doc:
                    items.append((doc_line, b"".join(doc)))
                    doc = []
                if size >= CHUNK_BYTES and (jsonl or not doc):
                    yield Chunk("jsonl" if jsonl else "text", str(path), first, items, size)
                    items, size, first = [], 0, lineno + 1
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    except Exception as e:  # zstandard raises its own error type on corrupted frames
        if type(e).__module__.startswith("zstandard") or "zstd" in type(e).__name__.lower():
            raise DataError(f"{path}: corrupted zstd stream ({e})") from None
        raise
    if doc:
        items.append((doc_line, b"".join(doc)))
    if items or size:
        yield Chunk("jsonl" if jsonl else "text", str(path), first, items, size)


def doc_chunks(docs: Iterable[str], where: str) -> Iterator[Chunk]:
    """Chunks of in-memory document strings (the built-in corpus)."""
    items: list[str] = []
    size = 0
    for d in docs:
        items.append(d)
        size += len(d.encode("utf-8", "surrogatepass"))
        if size >= CHUNK_BYTES:
            yield Chunk("docs", where, 0, items, size)
            items, size = [], 0
    if items:
        yield Chunk("docs", where, 0, items, size)

