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

import collections
import contextlib
import glob
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

from gptforge.data.encode_worker import (
    Options,
    chunk_documents,
    encode_chunk,
    encoder_spec,
    init_worker,
    single_threaded_children,
)
from gptforge.data.indexed import IDS_SUFFIX, IDX_SUFFIX, META_SUFFIX, ids_dtype, strip_suffix
from gptforge.data.text_inputs import CHUNK_BYTES, Chunk, doc_chunks, expand_inputs, file_chunks
from gptforge.durable import fsync_path
from gptforge.errors import DataError
from gptforge.fsguard import disk_full_errno, disk_full_error
from gptforge.run_lock import lock_prefix, path_writer_alive

if TYPE_CHECKING:  # pragma: no cover
    from gptforge.data.tokenizer import Tokenizer

HEADER_BYTES = 128  # .npy v1.0 header, written last once the length is known


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


def _stale_index_maps(prefix: Path) -> list[Path]:
    return list(prefix.parent.glob(f"{glob.escape(prefix.name)}_gpt_*_indexmap_*"))


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
    kind, payload = encoder_spec(tokenizer)
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
                init_worker(kind, payload)
                for chunk in chunks:
                    consume(encode_chunk(chunk, opt))
            else:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                # fork on Linux: no re-import of __main__ (scripts, notebooks, stdin all work) and
                # the parent's tokenizer caches are inherited; spawn elsewhere.
                method = "fork" if sys.platform.startswith("linux") else "spawn"
                executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                                               initializer=init_worker, initargs=(kind, payload, os.getpid()))
                pending: collections.deque = collections.deque()
                with single_threaded_children():  # workers start at the first submit
                    for chunk in chunks:  # at most 2 chunks per worker in flight: bounded memory
                        pending.append(executor.submit(encode_chunk, chunk, opt))
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


def finished_marker(output_prefix: str | os.PathLike) -> Path:
    """`<prefix>_idx.npz`: renamed last, so it exists exactly when a finished run's files are there.
    What a killed run published before it (`_ids.npy`, `_meta.json`) is not an output to protect:
    running again completes the set."""
    return Path(str(_output_prefix(output_prefix)) + IDX_SUFFIX)


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
            yield from file_chunks(f)

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
    return _run(doc_chunks(docs, source), _output_prefix(output_prefix), tokenizer, opt, n,
                total, progress, [source])


def iter_documents(inputs: Iterable[str | os.PathLike], json_key: str = "text", min_doc_length: int = 10,
                   strict: bool = False) -> Iterator[str]:
    """The documents `preprocess_files` would tokenize, in order (e.g. to train a tokenizer)."""
    opt = Options(json_key, False, 0, min_doc_length, strict)
    for f in expand_inputs(inputs):
        for chunk in file_chunks(f):
            yield from chunk_documents(chunk, opt)[0]


def stats_dict(stats: PreprocessStats) -> dict:
    d = asdict(stats)
    d["mb_per_s"] = round(stats.mb_per_s, 3)
    return d
