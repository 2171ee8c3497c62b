"""Token files in the reference's format, found, opened and checked.

`<prefix>_ids.npy`: every token id of the corpus, concatenated (uint16 when the vocabulary has
fewer than 65535 entries, else int32). `<prefix>_idx.npz`: `lens` (int32, tokens per document)
and `docs` (int64, cumulative sentence count per document, starting with 0; the dataset uses
only `lens`). The legacy `<prefix>_ids.npz` (keys `ids`, `lens`) is read with a warning. We also
write `<prefix>_meta.json` (tokenizer, counts, max id) beside them; other tools ignore it.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gptforge.errors import DataError

IDS_SUFFIX, IDX_SUFFIX, META_SUFFIX, LEGACY_SUFFIX = "_ids.npy", "_idx.npz", "_meta.json", "_ids.npz"


def ids_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (the reference's rule), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65535 else np.dtype(np.int32)


def strip_suffix(path: str) -> str:
    for suffix in (IDS_SUFFIX, IDX_SUFFIX, META_SUFFIX, LEGACY_SUFFIX):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def find_prefix(input_dir: str | os.PathLike) -> Path:
    """The token-file prefix that `input_dir` names: a directory (its first `*_idx.npz` in
    sorted order, as the reference), a prefix, or one of the files themselves."""
    text = strip_suffix(os.fspath(input_dir))
    p = Path(text)
    if Path(text + IDX_SUFFIX).is_file() or Path(text + LEGACY_SUFFIX).is_file():
        return p
    if p.is_dir():
        found = sorted(f.name[: -len(IDX_SUFFIX)] for f in p.iterdir() if f.name.endswith(IDX_SUFFIX) and f.is_file())
        if not found:
            found = sorted(f.name[: -len(LEGACY_SUFFIX)] for f in p.iterdir()
                           if f.name.endswith(LEGACY_SUFFIX) and f.is_file())
        if not found:
            raise DataError(
                f"{p}: no <prefix>_idx.npz token files in this directory; make them with "
                f"`gptforge preprocess --input TEXT --output-prefix {p}/NAME` (or use input_dir: builtin)"
            )
        if len(found) > 1:
            print(f"gptforge: {p} holds {len(found)} datasets; using the first, {found[0]!r} "
                  "(the reference reads only one; name a prefix to choose)", file=sys.stderr)
        return p / found[0]
    what = "is a file, expected a directory" if Path(input_dir).is_file() else "not found"
    raise DataError(
        f"{input_dir}: {what}; Data.*.dataset.input_dir must be a directory holding <prefix>_idx.npz, "
        "a prefix of <prefix>_ids.npy + <prefix>_idx.npz, or 'builtin' (text files need "
        "`gptforge preprocess` first)"
    )


@dataclass
class TokenFiles:
    """An opened, checked corpus: `ids` (memory-mapped) and per-document `lens`."""

    prefix: Path
    ids: np.ndarray
    lens: np.ndarray
    meta: dict = field(default_factory=dict)

    @property
    def n_docs(self) -> int:
        return int(len(self.lens))

    def max_id(self) -> int:
        """Largest token id (from the metadata when it describes this very file, else a scan)."""
        ids_file = Path(str(self.prefix) + IDS_SUFFIX)
        m = self.meta
        if "max_id" in m and ids_file.is_file() and m.get("ids_bytes") == ids_file.stat().st_size:
            return int(m["max_id"])
        best = -1
        step = 1 << 24
        for i in range(0, len(self.ids), step):
            best = max(best, int(np.max(self.ids[i:i + step])))
        return best


def _load_npz_key(path: Path, key: str) -> np.ndarray:
    try:
        with np.load(path, allow_pickle=False) as z:
            if key not in z.files:
                raise DataError(f"{path}: has no {key!r} array (found {', '.join(z.files) or 'none'}); "
                                "re-create it with `gptforge preprocess`")
            return np.asarray(z[key])
    except DataError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{path}: truncated or corrupted ({e}); re-create it with `gptforge preprocess`") from None


def load_token_files(prefix: str | os.PathLike) -> TokenFiles:
    """Open `<prefix>_ids.npy` + `<prefix>_idx.npz` (or the legacy `_ids.npz`) and check them."""
    prefix = Path(strip_suffix(os.fspath(prefix)))
    ids_path, idx_path = Path(str(prefix) + IDS_SUFFIX), Path(str(prefix) + IDX_SUFFIX)
    legacy = Path(str(prefix) + LEGACY_SUFFIX)
    if ids_path.is_file() and idx_path.is_file():
        try:
            ids = np.load(ids_path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise DataError(f"{ids_path}: truncated or corrupted ({e}); re-create it with `gptforge preprocess`") from None
        lens = _load_npz_key(idx_path, "lens")
        where = f"{ids_path} / {idx_path}"
    elif legacy.is_file():
        print(f"gptforge: {legacy} is the legacy token format; it is read into memory "
              "(re-run `gptforge preprocess` for the memory-mapped .npy format)", file=sys.stderr)
        ids, lens = _load_npz_key(legacy, "ids"), _load_npz_key(legacy, "lens")
        where = str(legacy)
    else:
        missing = ids_path if not ids_path.is_file() else idx_path
        raise DataError(f"{missing}: not found (token files come in pairs: {prefix.name}{IDS_SUFFIX} + "
                        f"{prefix.name}{IDX_SUFFIX})")
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"{where}: ids must be a 1-D integer array, got {ids.dtype} with shape {ids.shape}")
    if lens.ndim != 1 or not np.issubdtype(lens.dtype, np.integer):
        raise DataError(f"{where}: lens must be a 1-D integer array, got {lens.dtype} with shape {lens.shape}")
    if len(lens) and int(lens.min()) < 0:
        raise DataError(f"{where}: lens holds negative document lengths; the file is corrupted")
    total = int(np.sum(lens, dtype=np.int64))
    if total != len(ids):
        raise DataError(f"{where}: document lengths sum to {total} tokens but the ids file holds {len(ids)}; "
                        "the pair is from different runs or truncated: re-create it with `gptforge preprocess`")
    meta = {}
    meta_path = Path(str(prefix) + META_SUFFIX)
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            meta = {}
    return TokenFiles(prefix, ids, lens.astype(np.int64, copy=False), meta if isinstance(meta, dict) else {})
