"""Megatron's index mapping (doc_idx / sample_idx / shuffle_idx), built fast and cached safely.

The order of samples must equal the reference's bit for bit (spec §2.4, §13.3): documents of a
split are repeated for `num_epochs` and shuffled with `np.random.RandomState(seed)`, the last
epoch separately when it would add fewer than 80% of an epoch's samples; samples are
`seq_len + 1` tokens that share one boundary token; the sample order is a second shuffle from
the same RandomState. The reference builds `sample_idx` with a C++ loop; here it is a cumsum +
searchsorted over the token stream, which gives the same pairs (tests compare against a
transcription of the loop).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptforge.errors import DataError

INFO_VERSION = 1


def split_boundaries(weights: list[float] | str, size: int) -> list[int]:
    """Document boundaries [b0, b1, b2, b3] of Train/Eval/Test (the reference's rounding rule)."""
    if isinstance(weights, str):
        weights = [float(w) for w in weights.replace(" ", "").split(",") if w]
    w = [float(x) for x in weights][:3]
    w += [0.0] * (3 - len(w))
    total = sum(w)
    if total <= 0 or any(x < 0 for x in w):
        raise DataError(f"split {weights}: expected three non-negative weights like [949, 50, 1]")
    w = [x / total for x in w]
    bounds = [0]
    for x in w:
        bounds.append(bounds[-1] + int(round(x * float(size))))
    diff = bounds[-1] - size
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    # The reference asserts the same; clamp only guards against pathological tiny corpora.
    return [min(max(b, 0), size) for b in bounds]


def num_epochs_for(tokens_per_epoch: int, seq_len: int, num_samples: int) -> int:
    """Smallest e with (e * tokens_per_epoch - 1) // seq_len >= num_samples."""
    if tokens_per_epoch <= seq_len:
        raise DataError(
            f"the split has {tokens_per_epoch} tokens, not more than max_seq_len {seq_len}: "
            "lower Data.*.dataset.max_seq_len or give the split more data"
        )
    # Closed form of the reference's while-loop, checked against it below.
    e = max(1, -(-(num_samples * seq_len + 1) // tokens_per_epoch))
    while e > 1 and ((e - 1) * tokens_per_epoch - 1) // seq_len >= num_samples:
        e -= 1
    while (e * tokens_per_epoch - 1) // seq_len < num_samples:
        e += 1
    return e


def separate_last_epoch(tokens_per_epoch: int, seq_len: int, num_samples: int, num_epochs: int) -> bool:
    """True when the last epoch would contribute fewer than 80% of a full epoch's samples."""
    if num_epochs == 1:
        return False
    from_first = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_len
    last = num_samples - from_first
    per_epoch = (tokens_per_epoch - 1) // seq_len
    return last < int(0.80 * per_epoch)


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                  separate_last: bool) -> np.ndarray:
    """The split's document ids repeated num_epochs times and shuffled (int32)."""
    if not separate_last or num_epochs == 1:
        doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, rng, False)
    last = build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_len: int, num_epochs: int,
                     tokens_per_epoch: int) -> np.ndarray:
    """[n+1, 2] (index into doc_idx, token offset) where each sample starts.

    Sample j covers token-stream positions j*seq_len .. (j+1)*seq_len inclusive; the pair for a
    position is the document holding it, so a boundary that ends a document exactly points at
    that document's last token, as in the reference loop.
    """
    n = (num_epochs * tokens_per_epoch - 1) // seq_len
    starts = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64)[doc_idx], out=starts[1:])
    pos = np.arange(n + 1, dtype=np.int64) * seq_len
    which = np.searchsorted(starts, pos, side="right") - 1
    dtype = np.int32 if max(len(doc_idx), int(starts[-1])) < np.iinfo(np.int32).max else np.int64
    out = np.empty((n + 1, 2), dtype=dtype)
    out[:, 0] = which
    out[:, 1] = pos - starts[which]
    out[0] = (0, 0)  # the loop starts at (0, 0) even when the first document is empty
    return out


def build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, total_size); [num_samples, total_size) is shuffled on its own."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


@dataclass
class IndexMaps:
    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray
    num_epochs: int
    tokens_per_epoch: int


def compute_index_maps(sizes: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int,
                       seed: int) -> IndexMaps:
    """Megatron's `_build_index_mappings` without the caching."""
    sizes = np.asarray(sizes)
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    epochs = num_epochs_for(tokens_per_epoch, seq_len, num_samples)
    sep = separate_last_epoch(tokens_per_epoch, seq_len, num_samples, epochs)
    rng = np.random.RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, epochs, rng, sep)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_len, epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    first = ((epochs - 1) * tokens_per_epoch - 1) // seq_len if sep else total
    shuffle_idx = build_shuffle_idx(first, total, rng)
    return IndexMaps(doc_idx, sample_idx, shuffle_idx, epochs, tokens_per_epoch)


# ------------------------------------------------------------------------------ caching


def cache_root() -> Path:
    """$GPTFORGE_CACHE, else ~/.cache/gptforge."""
    return Path(os.environ.get("GPTFORGE_CACHE") or Path.home() / ".cache" / "gptforge")


def map_basename(prefix: str | os.PathLike, mode: str, num_samples: int, seq_len: int) -> str:
    return f"{Path(prefix).name}_gpt_{mode}_indexmap_{num_samples}ns_{seq_len}sl"


def map_dir(prefix: str | os.PathLike) -> Path:
    """Next to the data, or a per-prefix cache directory when the data directory is read-only."""
    parent = Path(prefix).resolve().parent
    if os.access(parent, os.W_OK):
        return parent
    digest = hashlib.sha1(str(Path(prefix).resolve()).encode()).hexdigest()[:16]
    return cache_root() / "indexmaps" / digest


def _paths(base: Path) -> dict[str, Path]:
    return {k: base.with_name(f"{base.name}_{k}_idx.npy") for k in ("doc", "sample", "shuffle")}


def _save_atomic(path: Path, array: np.ndarray | dict) -> None:
    """An .npy array (or a JSON dict) written under a temporary name and renamed."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(array, dict):
                f.write(json.dumps(array).encode())
            else:
                np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _info(documents: np.ndarray, seed: int, sizes: np.ndarray, tokens_per_epoch: int) -> dict:
    """What the maps depend on besides the names: seed, split range and every document length."""
    lens_hash = hashlib.sha1(np.ascontiguousarray(sizes, dtype=np.int64).tobytes()).hexdigest()[:16]
    return {"version": INFO_VERSION, "seed": int(seed), "n_docs_total": int(len(sizes)),
            "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
            "tokens_per_epoch": int(tokens_per_epoch), "lens_sha1": lens_hash}


def _load_cached(base: Path, want: dict, n_split_docs: int, seq_len: int, epochs: int) -> IndexMaps | None:
    """Cached maps if they exist and fit this data, seed and split; None to rebuild."""
    paths = _paths(base)
    if not all(p.is_file() for p in paths.values()):
        return None
    info_path = base.with_name(base.name + "_info.json")
    if info_path.is_file():  # maps the reference built carry no info file; we check shapes only
        try:
            have = json.loads(info_path.read_text())
        except (OSError, ValueError):
            return None
        if have != want:
            return None
    try:
        doc_idx, sample_idx, shuffle_idx = (np.load(paths[k], allow_pickle=False, mmap_mode="r")
                                            for k in ("doc", "sample", "shuffle"))
    except (OSError, ValueError, EOFError):  # a damaged cache is rebuilt (EOFError: an empty file)
        return None
    tpe = want["tokens_per_epoch"]
    ok = (len(doc_idx) == epochs * n_split_docs and sample_idx.ndim == 2
          and len(sample_idx) == (epochs * tpe - 1) // seq_len + 1 and len(shuffle_idx) == len(sample_idx) - 1)
    if not ok:
        return None
    return IndexMaps(doc_idx, sample_idx, shuffle_idx, epochs, tpe)


def _dist_state() -> tuple[bool, bool]:
    """(process group initialised, this process builds): local rank 0 builds."""
    dist = sys.modules.get("torch.distributed")
    initialised = bool(dist is not None and dist.is_available() and dist.is_initialized())
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return initialised, local_rank == 0


def load_or_build_index_maps(prefix: str | os.PathLike, mode: str, sizes: np.ndarray, documents: np.ndarray,
                             seq_len: int, num_samples: int, seed: int, verbose: bool = True) -> IndexMaps:
    """Cached maps `<prefix>_gpt_<mode>_indexmap_<ns>ns_<sl>sl_{doc,sample,shuffle}_idx.npy`.

    Under torch.distributed local rank 0 builds and the others wait at a barrier; without a
    process group every process that finds no cache builds and renames its files into place,
    so concurrent processes are safe (they write identical arrays).
    """
    documents = np.asarray(documents)
    tokens_per_epoch = int(np.sum(np.asarray(sizes)[documents], dtype=np.int64))
    epochs = num_epochs_for(tokens_per_epoch, seq_len, num_samples)  # DataError before anyone waits
    base = map_dir(prefix) / map_basename(prefix, mode, num_samples, seq_len)
    want = _info(documents, seed, np.asarray(sizes), tokens_per_epoch)
    initialised, builder = _dist_state()

    def build() -> IndexMaps:
        maps = _load_cached(base, want, len(documents), seq_len, epochs)
        if maps is not None:
            return maps
        import time

        t0 = time.perf_counter()
        maps = compute_index_maps(sizes, documents, seq_len, num_samples, seed)
        try:
            base.parent.mkdir(parents=True, exist_ok=True)
            for key, arr in (("doc", maps.doc_idx), ("sample", maps.sample_idx), ("shuffle", maps.shuffle_idx)):
                _save_atomic(_paths(base)[key], arr)
            _save_atomic(base.with_name(base.name + "_info.json"), want)  # last: marks the set complete
        except OSError as e:  # an unwritable cache only costs a rebuild next time
            print(f"gptforge: could not cache index maps in {base.parent} ({e})", file=sys.stderr)
        if verbose:
            from gptforge.progress import info  # --quiet drops it

            info(f"gptforge: built {mode} index maps: {len(maps.shuffle_idx)} samples of {seq_len} tokens, "
                 f"{maps.num_epochs} epoch(s) in {time.perf_counter() - t0:.2f}s -> {base.parent}")
        return maps

    if not initialised:
        return build()
    import torch.distributed as dist

    maps = build() if builder else None
    dist.barrier()
    if maps is None:
        maps = _load_cached(base, want, len(documents), seq_len, epochs)
        if maps is None:  # e.g. no shared filesystem between nodes
            maps = compute_index_maps(sizes, documents, seq_len, num_samples, seed)
    return maps
