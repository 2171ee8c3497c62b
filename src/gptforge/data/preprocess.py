"""Raw text / jsonl → `<prefix>_ids.npy` + `<prefix>_idx.npz` (the reference's token files).

Streaming: the main process reads the input in ~1 MB chunks of documents, worker processes
tokenize them, and the results are appended in input order to a temporary ids file, so memory
stays bounded on multi-GB inputs. GPT-2's vocabulary is encoded with tiktoken (built from the
same local files; identical ids, about 4x faster than HF tokenizers), other vocabularies with
HF tokenizers. Outputs appear only at the end, by fsync + rename (`_idx.npz` last); on any
error the temporary files are removed and nothing is left behind.

One writer per prefix (`run_lock.lock_prefix`): a second preprocess into the same prefix fails at
once naming the first one's pid. Temp files carry the writer's pid (`.<name>_ids.npy.<pid>.*.tmp`)
and a later run removes those of dead writers. Workers die with the main process: a parent-death
signal on Linux and, everywhere, a watchdog thread that exits when the parent pid changes.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import glob
import io
import itertools
import json
import os
import struct
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gptforge.data.indexed import IDS_SUFFIX, IDX_SUFFIX, META_SUFFIX, ids_dtype, strip_suffix
from gptforge.durable import fsync_path
from gptforge.errors import DataError
from gptforge.fsguard import disk_full_errno, disk_full_error
from gptforge.run_lock import lock_prefix, path_writer_alive

if TYPE_CHECKING:  # pragma: no cover
    from gptforge.data.tokenizer import Tokenizer

CHUNK_BYTES = 1 << 20
HEADER_BYTES = 128  # .npy v1.0 header, written last once the length is known
JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.zst", ".json.zst")  # any other named file is text
# What a directory contributes (.json left out: metadata files such as our own _meta.json live there).
DIR_SUFFIXES = (".jsonl", ".jsonl.zst", ".txt", ".text", ".md", ".rst", ".txt.zst")

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


def _init_worker(kind: str, payload: str | None, parent: int | None = None) -> None:
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
class Chunk:
    kind: str  # text | jsonl | docs
    where: str
    first_line: int
    items: list  # raw bytes documents / raw jsonl lines / str documents
    nbytes: int


@dataclass
class Options:
    json_key: str = "text"
    append_eos: bool = False
    eos_id: int = 0
    min_doc_length: int = 10
    strict: bool = False


def _documents(chunk: Chunk, opt: Options) -> tuple[list[str], int]:
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


def _encode_chunk(chunk: Chunk, opt: Options) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """(ids, lens, documents dropped, bad UTF-8 sequences replaced, bytes) of one chunk."""
    global _bad_utf8
    _bad_utf8 = 0
    docs, dropped = _documents(chunk, opt)
    encoded = _ENCODE(docs) if docs else []
    if opt.append_eos:
        for ids in encoded:
            ids.append(opt.eos_id)
    lens = np.fromiter((len(x) for x in encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lens.sum()))
    keep = lens > 0
    return flat, lens[keep], dropped + int((~keep).sum()), _bad_utf8, chunk.nbytes


# ------------------------------------------------------------------------------ inputs


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


def _file_chunks(path: Path) -> Iterator[Chunk]:
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


def _doc_chunks(docs: Iterable[str], where: str) -> Iterator[Chunk]:
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


# ------------------------------------------------------------------------------ output


def _npy_header(dtype: np.dtype, n: int) -> bytes:
    descr = np.lib.format.dtype_to_descr(dtype)
    body = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': ({n},), }}"
    body = body.ljust(HEADER_BYTES - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")


@dataclass
class PreprocessStats:
    """What a preprocess run did."""

    output_prefix: str = ""
    documents: int = 0
    tokens: int = 0
    bytes_in: int = 0
    dropped: int = 0
    invalid_utf8_replaced: int = 0
    seconds: float = 0.0
    workers: int = 1
    files: list[str] = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_in / 1e6 / max(self.seconds, 1e-9)


def _encoder_spec(tokenizer: Tokenizer) -> tuple[str, str | None]:
    return ("tiktoken", None) if tokenizer.is_gpt2() else ("hf", tokenizer.to_str())


def _stale_index_maps(prefix: Path) -> list[Path]:
    return list(prefix.parent.glob(f"{glob.escape(prefix.name)}_gpt_*_indexmap_*"))


@contextlib.contextmanager
def _single_threaded_children():
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


def _run(chunks: Iterator[Chunk], prefix: Path, tokenizer: Tokenizer, opt: Options, workers: int,
         total_bytes: int | None, progress: bool, sources: list[str]) -> PreprocessStats:
    from gptforge.progress import bar as progress_bar

    dtype = ids_dtype(tokenizer.vocab_size)
    created = []  # directories this run makes, deepest first, removed again on failure
    d = prefix.parent.absolute()
    while not d.exists():
        created.append(d)
        d = d.parent
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{prefix.parent}: cannot create the output directory ({e.strerror or e})") from None
    lock = lock_prefix(prefix, "preprocess")  # a second writer of this prefix fails here, naming us
    done = False
    stats = PreprocessStats(output_prefix=str(prefix), workers=workers, files=sources)
    lens_parts: list[np.ndarray] = []
    max_id = -1
    temps: list[str] = []

    def temp(suffix: str) -> tuple[int, str]:
        fd, name = tempfile.mkstemp(prefix=f".{prefix.name}{suffix}.{os.getpid()}.", suffix=".tmp",
                                    dir=prefix.parent)
        temps.append(name)
        return fd, name

    t0 = time.perf_counter()
    kind, payload = _encoder_spec(tokenizer)
    executor = None
    bar = progress_bar(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", enabled=progress)
    try:
        remove_stale_temps(prefix)  # of killed runs into this prefix
        fd, ids_tmp = temp(IDS_SUFFIX)
        with os.fdopen(fd, "wb") as out:
            out.write(b"\0" * HEADER_BYTES)

            def consume(result) -> None:
                nonlocal max_id
                flat, lens, dropped, bad, nbytes = result
                if len(flat):
                    max_id = max(max_id, int(flat.max()))
                    if int(flat.min()) < 0 or max_id >= tokenizer.vocab_size:  # never for a sane tokenizer
                        raise DataError(f"tokenizer {tokenizer.name!r} produced id {max_id} outside its vocabulary")
                    out.write(flat.astype(dtype).tobytes())
                lens_parts.append(lens.astype(np.int32))
                stats.tokens += len(flat)
                stats.documents += len(lens)
                stats.dropped += dropped
                stats.invalid_utf8_replaced += bad
                stats.bytes_in += nbytes
                bar.update(nbytes)

            if workers <= 1:
                _init_worker(kind, payload)
                for chunk in chunks:
                    consume(_encode_chunk(chunk, opt))
            else:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                # fork on Linux: no re-import of __main__ (scripts, notebooks, stdin all work) and
                # the parent's tokenizer caches are inherited; spawn elsewhere.
                method = "fork" if sys.platform.startswith("linux") else "spawn"
                executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                                               initializer=_init_worker, initargs=(kind, payload, os.getpid()))
                pending: collections.deque = collections.deque()
                with _single_threaded_children():  # workers start at the first submit
                    for chunk in chunks:  # at most 2 chunks per worker in flight: bounded memory
                        pending.append(executor.submit(_encode_chunk, chunk, opt))
                        if len(pending) >= 2 * workers:
                            consume(pending.popleft().result())
                    while pending:
                        consume(pending.popleft().result())
            if stats.documents == 0:
                if stats.bytes_in == 0:
                    raise DataError(f"empty input: {', '.join(sources) or 'no text'} holds no text")
                raise DataError(f"no documents left after filtering: {stats.dropped} read, all shorter than "
                                f"--min-doc-length {opt.min_doc_length} characters or empty; lower it")
            out.seek(0)
            out.write(_npy_header(dtype, stats.tokens))
            out.flush()
            os.fsync(out.fileno())  # durable before the rename publishes it
        bar.close()
        lens = np.concatenate(lens_parts)
        fd, idx_tmp = temp(IDX_SUFFIX)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, lens=lens, docs=np.arange(len(lens) + 1, dtype=np.int64))
            f.flush()
            os.fsync(f.fileno())
        stats.seconds = time.perf_counter() - t0
        meta = {
            "format": "gptforge-tokens/1", "tokenizer": tokenizer.name, "fingerprint": tokenizer.fingerprint(),
            "vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.eos_token_id, "dtype": dtype.name,
            "documents": stats.documents, "tokens": stats.tokens, "max_id": max_id,
            "ids_bytes": HEADER_BYTES + stats.tokens * dtype.itemsize, "append_eos": opt.append_eos,
            "min_doc_length": opt.min_doc_length, "json_key": opt.json_key, "dropped": stats.dropped,
            "invalid_utf8_replaced": stats.invalid_utf8_replaced, "inputs": sources[:1000],
        }
        fd, meta_tmp = temp(META_SUFFIX)
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        for stale in _stale_index_maps(prefix):  # maps of an older corpus with this prefix
            with contextlib.suppress(OSError):
                stale.unlink()
        # An older corpus under this prefix stops looking complete first: a kill between the renames
        # below must not leave new ids next to the old index.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(str(prefix) + IDX_SUFFIX)
        for tmp, suffix in ((ids_tmp, IDS_SUFFIX), (meta_tmp, META_SUFFIX), (idx_tmp, IDX_SUFFIX)):
            os.chmod(tmp, 0o644)
            os.replace(tmp, str(prefix) + suffix)
            temps.remove(tmp)
        fsync_path(prefix.parent)
        done = True
        return stats
    except OSError as e:  # disk full, permissions: one line, nothing left behind (below)
        code = disk_full_errno(e)
        if code is not None:
            raise disk_full_error(f"{prefix}{IDS_SUFFIX} + {IDX_SUFFIX}", code) from None
        raise DataError(f"{prefix}: cannot write the output ({e.strerror or e})") from None
    finally:
        bar.close()
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        for name in temps:
            with contextlib.suppress(OSError):
                os.unlink(name)
        lock.release()
        if not done:
            for d in created:
                with contextlib.suppress(OSError):
                    d.rmdir()


def remove_stale_temps(prefix: Path) -> list[Path]:
    """Remove the temp files of earlier runs into `prefix` whose writer is dead (a temp named
    without a pid comes from an older version and counts as dead: the caller holds the lock)."""
    import re

    pat = re.compile(rf"^\.{re.escape(prefix.name)}(?:{'|'.join(map(re.escape, (IDS_SUFFIX, IDX_SUFFIX, META_SUFFIX)))})"
                     r"\.(?:(\d+)\.)?[^.]+\.tmp$")
    removed = []
    if not prefix.parent.is_dir():
        return removed
    for c in prefix.parent.iterdir():
        m = pat.match(c.name)
        if m is None or not c.is_file():
            continue
        if m.group(1) is not None and path_writer_alive(int(m.group(1)), c):
            continue
        with contextlib.suppress(OSError):
            c.unlink()
            removed.append(c)
    return removed


def _output_prefix(output_prefix: str | os.PathLike) -> Path:
    text = strip_suffix(os.fspath(output_prefix))
    if not text or text.endswith(("/", os.sep)) or Path(text).is_dir():
        raise DataError(f"--output-prefix {text!r}: is a directory; give a file-name prefix such as "
                        f"{os.path.join(text.rstrip('/') or '.', 'NAME')}")
    return Path(text)


def default_workers(total_bytes: int | None) -> int:
    """All cores for big inputs; in-process below 4 MB, where starting workers costs more."""
    if total_bytes is not None and total_bytes < 4 * CHUNK_BYTES:
        return 1
    return max(1, min(os.cpu_count() or 1, 16))


def preprocess_files(inputs: Iterable[str | os.PathLike], output_prefix: str | os.PathLike, tokenizer: Tokenizer,
                     json_key: str = "text", append_eos: bool = False, min_doc_length: int = 10,
                     workers: int | None = None, strict: bool = False, progress: bool = True) -> PreprocessStats:
    """Tokenize text files (documents split on blank lines) and jsonl files (`json_key`, optionally
    .zst) into `<output_prefix>_ids.npy` + `_idx.npz`. Files are read in sorted order."""
    files = expand_inputs(inputs)
    total = sum(f.stat().st_size for f in files)
    compressed = any(f.name.lower().endswith(".zst") for f in files)

    def chunks() -> Iterator[Chunk]:
        for f in files:
            yield from _file_chunks(f)

    opt = Options(json_key, append_eos, tokenizer.eos_token_id, min_doc_length, strict)
    n = workers if workers is not None else default_workers(None if compressed else total)
    return _run(chunks(), _output_prefix(output_prefix), tokenizer, opt, n,
                None if compressed else total, progress, [str(f) for f in files])


def preprocess_documents(docs: Iterable[str], output_prefix: str | os.PathLike, tokenizer: Tokenizer,
                         append_eos: bool = True, min_doc_length: int = 10, workers: int | None = None,
                         progress: bool = True, source: str = "documents") -> PreprocessStats:
    """Tokenize an iterable of document strings (the built-in corpus) into token files."""
    docs = list(docs) if not isinstance(docs, list) else docs
    total = sum(len(d.encode("utf-8", "surrogatepass")) for d in docs)
    opt = Options("text", append_eos, tokenizer.eos_token_id, min_doc_length, False)
    n = workers if workers is not None else default_workers(total)
    return _run(_doc_chunks(docs, source), _output_prefix(output_prefix), tokenizer, opt, n,
                total, progress, [source])


def iter_documents(inputs: Iterable[str | os.PathLike], json_key: str = "text", min_doc_length: int = 10,
                   strict: bool = False) -> Iterator[str]:
    """The documents `preprocess_files` would tokenize, in order (e.g. to train a tokenizer)."""
    opt = Options(json_key, False, 0, min_doc_length, strict)
    for f in expand_inputs(inputs):
        for chunk in _file_chunks(f):
            yield from _documents(chunk, opt)[0]


def stats_dict(stats: PreprocessStats) -> dict:
    d = asdict(stats)
    d["mb_per_s"] = round(stats.mb_per_s, 3)
    return d
