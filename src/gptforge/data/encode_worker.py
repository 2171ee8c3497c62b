"""Preprocess workers: decode and filter a `Chunk`'s documents and tokenize them, in the main
process or in pool workers that die with it (a parent-death signal on Linux and, everywhere, a
watchdog thread that exits when the parent pid changes)."""

from __future__ import annotations

import codecs
import contextlib
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gptforge.data.text_inputs import Chunk
from gptforge.errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    from gptforge.data.tokenizer import Tokenizer

# ------------------------------------------------------------------------------ decoding

_bad_utf8 = 0


def _count_bad(err: UnicodeDecodeError):
    global _bad_utf8
    _bad_utf8 += 1
    return "\ufffd", err.end


codecs.register_error("gptforge.count", _count_bad)


def _decode(raw: bytes, strict: bool, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if strict:
            raise DataError(f"{where}: invalid UTF-8 ({e.reason} at byte {e.start} of the document); "
                            "fix the file or drop --strict to replace bad bytes") from None
        return raw.decode("utf-8", errors="gptforge.count")


def _no_lone_surrogates(text: str, strict: bool, where: str) -> str:
    """JSON escapes like "\\ud800" decode to text no UTF-8 tokenizer accepts: replace (and count)."""
    global _bad_utf8
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        if strict:
            raise DataError(f"{where}: a lone surrogate escape ({e.object[e.start:e.end]!r}) is not valid "
                            "Unicode text; fix the line or drop --strict to replace it") from None
        _bad_utf8 += sum(1 for ch in text if "\ud800" <= ch <= "\udfff")
        return text.encode("utf-8", errors="replace").decode("utf-8")


# ------------------------------------------------------------------------------ workers

_ENCODE = None
WATCHDOG_SECONDS = 1.0


def _die_with_parent(parent: int) -> None:
    """Make this worker exit when the process that started it dies, even by SIGKILL (which
    gives the pool no chance to stop its workers)."""
    import signal
    import threading

    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:  # the fallback where there is no parent-death signal
        while True:
            time.sleep(WATCHDOG_SECONDS)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="gptforge-parent-watchdog", daemon=True).start()


def init_worker(kind: str, payload: str | None, parent: int | None = None) -> None:
    """Build the encoder once per process: ('tiktoken', None) or ('hf', tokenizer.json text).
    `parent`: the main process's pid, set in pool workers (they exit when it dies)."""
    global _ENCODE
    if parent is not None:
        _die_with_parent(parent)
    if kind == "tiktoken":
        from gptforge.data.tokenizer import tiktoken_gpt2

        enc = tiktoken_gpt2()
        _ENCODE = lambda texts: enc.encode_batch(texts, allowed_special="all", num_threads=1)  # noqa: E731
    else:
        from gptforge.data.tokenizer import from_str

        tok = from_str(payload or "")
        _ENCODE = tok.encode_batch


@dataclass
class Options:
    json_key: str = "text"
    append_eos: bool = False
    eos_id: int = 0
    min_doc_length: int = 10
    strict: bool = False



def chunk_documents(chunk: Chunk, opt: Options) -> tuple[list[str], int]:
    """(kept documents, number dropped as too short) of one chunk."""
    texts: list[str] = []
    if chunk.kind == "jsonl":
        for k, line in enumerate(chunk.items):
            where = f"{chunk.where}:{chunk.first_line + k}"
            if not line.strip():
                continue
            try:
                obj = json.loads(_decode(line, opt.strict, where))
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
            if opt.json_key not in obj:
                keys = ", ".join(map(repr, list(obj)[:8])) or "none"
                raise DataError(f"{where}: no key {opt.json_key!r} (keys: {keys}); choose one with --json-key")
            value = obj[opt.json_key]
            if not isinstance(value, str):
                raise DataError(f"{where}: the value of {opt.json_key!r} is not a string "
                                f"(got {type(value).__name__}); fix the line or choose another --json-key")
            texts.append(value if value.isascii() else _no_lone_surrogates(value, opt.strict, where))
    elif chunk.kind == "text":
        texts = [_decode(doc, opt.strict, f"{chunk.where}: document at line {line}")
                 for line, doc in chunk.items]
    else:
        texts = chunk.items
    kept = [t.strip() for t in texts if len(t) > opt.min_doc_length]
    kept = [t for t in kept if t]
    return kept, len(texts) - len(kept)


def encode_chunk(chunk: Chunk, opt: Options) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """(ids, lens, documents dropped, bad UTF-8 sequences replaced, bytes) of one chunk."""
    global _bad_utf8
    _bad_utf8 = 0
    docs, dropped = chunk_documents(chunk, opt)
    encoded = _ENCODE(docs) if docs else []
    if opt.append_eos:
        for ids in encoded:
            ids.append(opt.eos_id)
    lens = np.fromiter((len(x) for x in encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lens.sum()))
    keep = lens > 0
    return flat, lens[keep], dropped + int((~keep).sum()), _bad_utf8, chunk.nbytes


def encoder_spec(tokenizer: Tokenizer) -> tuple[str, str | None]:
    """`init_worker`'s arguments for `tokenizer` (picklable, so pool workers can rebuild it)."""
    return ("tiktoken", None) if tokenizer.is_gpt2() else ("hf", tokenizer.to_str())



@contextlib.contextmanager
def single_threaded_children():
    """Workers inherit TOKENIZERS_PARALLELISM=false: one process per core, no thread pools inside
    (and no fork warning from HF tokenizers); the parent's setting is restored after."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old

