"""The reference's GPTDataset (Megatron-style), its batch sampler, collation and `build_datasets`.

A sample is `max_seq_len + 1` consecutive tokens of the shuffled document stream; consecutive
samples share one boundary token (spec §2.4). Position ids run 0..S-1 without reset at
document boundaries and the loss mask is all ones, as in the reference.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gptforge.data.index_map import load_or_build_index_maps, split_boundaries
from gptforge.data.indexed import IDS_SUFFIX, TokenFiles, find_prefix, load_token_files
from gptforge.errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from gptforge.config import Config
    from gptforge.data.tokenizer import Tokenizer

MODES = ("Train", "Eval", "Test")


class GPTDataset:
    """Map-style dataset over one split of a token corpus (usable with torch's DataLoader)."""

    def __init__(self, files: TokenFiles, mode: str, documents: np.ndarray, seq_len: int, num_samples: int,
                 seed: int):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if len(documents) == 0:
            raise DataError(f"{files.prefix}: the {mode} split has no documents")
        self.mode, self.seq_len, self.seed = mode, int(seq_len), int(seed)
        self.prefix = files.prefix
        self.num_samples = int(num_samples)
        self.documents = np.asarray(documents)
        self._ids = files.ids
        self.lens = files.lens
        maps = load_or_build_index_maps(files.prefix, mode, files.lens, self.documents, seq_len, num_samples, seed)
        self.doc_idx, self.sample_idx, self.shuffle_idx = maps.doc_idx, maps.sample_idx, maps.shuffle_idx
        self.num_epochs = maps.num_epochs
        self.starts = np.zeros(len(files.lens) + 1, dtype=np.int64)
        np.cumsum(files.lens, out=self.starts[1:])
        self._positions = np.arange(self.seq_len, dtype=np.int64)
        self._mask = np.ones(self.seq_len, dtype=np.float32)

    def __len__(self) -> int:
        return len(self.sample_idx) - 1

    def sample_tokens(self, i: int) -> np.ndarray:
        """The seq_len + 1 tokens of sample `i` (after the shuffle), as int64."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n}")
        j = int(self.shuffle_idx[i % n])
        d0, o0 = (int(x) for x in self.sample_idx[j])
        d1, o1 = (int(x) for x in self.sample_idx[j + 1])
        if d0 == d1:
            a = self.starts[self.doc_idx[d0]] + o0
            out = np.asarray(self._ids[a:a + (o1 - o0) + 1], dtype=np.int64)
        else:
            parts = [self._ids[self.starts[self.doc_idx[d0]] + o0:self.starts[self.doc_idx[d0] + 1]]]
            for d in range(d0 + 1, d1):
                doc = self.doc_idx[d]
                parts.append(self._ids[self.starts[doc]:self.starts[doc + 1]])
            a = self.starts[self.doc_idx[d1]]
            parts.append(self._ids[a:a + o1 + 1])
            out = np.concatenate(parts).astype(np.int64, copy=False)
        if len(out) != self.seq_len + 1:  # would mean the maps do not fit the data
            raise DataError(f"{self.prefix}: sample {i} has {len(out)} tokens, expected {self.seq_len + 1}; "
                            "delete the cached *_indexmap_* files next to the data and retry")
        return out

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        t = self.sample_tokens(i)
        return {"tokens": t[:-1], "labels": t[1:], "position_ids": self._positions.copy(),
                "loss_mask": self._mask.copy()}

    # A memory-mapped file is re-opened in DataLoader workers instead of being pickled by value.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if isinstance(self._ids, np.memmap):
            state["_ids"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._ids is None:
            self._ids = np.load(str(self.prefix) + IDS_SUFFIX, mmap_mode="r", allow_pickle=False)


class GPTBatchSampler:
    """Deterministic batches of dataset indices for one data rank (the reference's sampler).

    Each global step takes the next `local_batch_size * data_world_size` indices; data rank r
    gets the slice [r * local_batch_size, (r + 1) * local_batch_size) of it. Order comes from
    the dataset's shuffle_idx, so nothing is shuffled here. Indices past the end wrap around
    (the epoch is padded to a multiple of the data world). `consumed_samples` resumes a run:
    the iteration yields exactly the batches an uninterrupted run would yield after that many
    samples, including in a later pass; after a pass completes, the next pass starts at 0.
    """

    def __init__(self, dataset_len: int, local_batch_size: int, data_rank: int = 0,
                 data_world_size: int = 1, consumed_samples: int = 0, drop_last: bool = True):
        if dataset_len <= 0:
            raise DataError("the dataset is empty: nothing to sample")
        if local_batch_size <= 0 or data_world_size <= 0 or not 0 <= data_rank < data_world_size:
            raise ValueError(f"bad sampler geometry: local_batch_size={local_batch_size}, "
                             f"data_rank={data_rank}, data_world_size={data_world_size}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.dataset_len = int(dataset_len)
        self.local_batch_size, self.rank, self.world = int(local_batch_size), int(data_rank), int(data_world_size)
        self.global_batch_size = self.local_batch_size * self.world
        self.drop_last = drop_last
        self.total_size = math.ceil(self.dataset_len / self.world) * self.world
        self.consumed_samples = int(consumed_samples)
        self._start = self._pass_position(self.consumed_samples)

    def _batches_per_pass(self) -> int:
        full, rest = divmod(self.total_size, self.global_batch_size)
        return full + (1 if rest // self.world and not self.drop_last else 0)

    def _pass_position(self, consumed: int) -> int:
        """Where in a pass an uninterrupted run stands after `consumed` samples."""
        per_pass = self._batches_per_pass()
        steps, extra = divmod(consumed, self.global_batch_size)
        if per_pass == 0:
            return 0
        # A run counts consumed = steps * global batch; steps beyond a pass continue in the next one.
        return (steps % per_pass) * self.global_batch_size + extra

    def _starts(self, start: int) -> Iterator[tuple[int, int]]:
        while start + self.global_batch_size <= self.total_size:
            yield start + self.rank * self.local_batch_size, self.local_batch_size
            start += self.global_batch_size
        share = (self.total_size - start) // self.world
        if share and not self.drop_last:
            yield start + self.rank * share, share

    def __iter__(self) -> Iterator[list[int]]:
        start, self._start = self._start, 0
        n = self.dataset_len
        for first, size in self._starts(start):
            yield [(first + j) % n for j in range(size)]

    def __len__(self) -> int:
        return sum(1 for _ in self._starts(self._start))


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack samples into [B, S] tensors: int64 ids/labels/positions, float32 loss_mask."""
    import torch

    out = {}
    for key in samples[0]:
        arr = np.stack([s[key] for s in samples])
        dtype = np.float32 if key == "loss_mask" else np.int64
        out[key] = torch.from_numpy(arr.astype(dtype, copy=False))
    return out


# ------------------------------------------------------------------------------ building


def default_num_samples(cfg: Config, mode: str) -> int:
    """Samples a run draws from a split (spec §2.4)."""
    gbs, e = cfg.Global.global_batch_size or 1, cfg.Engine
    if mode == "Train":
        return gbs * e.max_steps
    if mode == "Eval":
        evals = e.max_steps // e.eval_freq + 1 if e.eval_freq > 0 else 1
        return gbs * evals * e.eval_iters
    return gbs * (e.test_iters if e.test_iters is not None else 10 * e.eval_iters)


def resolve_prefix(input_dir: str, tokenizer: Tokenizer) -> Path:
    """The token-file prefix for `input_dir` ('builtin' prepares the built-in corpus once;
    under torch.distributed local rank 0 prepares it while the others wait)."""
    if str(input_dir).strip().lower() != "builtin":
        return find_prefix(os.path.expanduser(str(input_dir)))
    from gptforge.data.corpus import builtin_token_files
    from gptforge.data.index_map import _dist_state

    initialised, builder = _dist_state()
    if not initialised:
        return builtin_token_files(tokenizer)
    import torch.distributed as dist

    prefix = builtin_token_files(tokenizer) if builder else None
    dist.barrier()
    return prefix if prefix is not None else builtin_token_files(tokenizer)


def _input_dir(cfg: Config, mode: str) -> str:
    """`Data.<mode>.dataset.input_dir`; an Eval/Test split left at the default path that does
    not exist reads the Train corpus (the reference's recipes always set both to the same)."""
    from gptforge.config.schema import DatasetConfig

    own = getattr(cfg.Data, mode).dataset.input_dir
    train = cfg.Data.Train.dataset.input_dir
    if mode != "Train" and own == DatasetConfig().input_dir and train != own and not os.path.exists(own):
        return train
    return own


def check_vocab(files: TokenFiles, tokenizer: Tokenizer, model_vocab: int) -> None:
    """The data, the tokenizer and the model must agree on the vocabulary."""
    if tokenizer.vocab_size > model_vocab:
        raise DataError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but Model.vocab_size is {model_vocab}; "
            f"raise Model.vocab_size (>= {tokenizer.vocab_size}) or set Data.tokenizer to the model's tokenizer"
        )
    meta = files.meta
    if meta.get("fingerprint") and meta["fingerprint"] != tokenizer.fingerprint():
        raise DataError(
            f"{files.prefix}: was tokenized with {meta.get('tokenizer', '?')!r} ({meta.get('vocab_size')} tokens) "
            f"but this run's tokenizer is {tokenizer.name!r} ({tokenizer.vocab_size} tokens); set "
            f"Data.tokenizer to the data's tokenizer or re-run `gptforge preprocess` with this one"
        )
    top = files.max_id()
    if top >= model_vocab:
        raise DataError(
            f"{files.prefix}{IDS_SUFFIX}: holds token id {top} but Model.vocab_size is {model_vocab}; "
            "the data was made with a larger vocabulary: raise Model.vocab_size or re-run preprocess"
        )


def build_datasets(cfg: Config, splits: tuple[str, ...] = ("Train", "Eval"),
                   num_samples: dict[str, int] | None = None,
                   tokenizer: Tokenizer | None = None) -> dict[str, GPTDataset]:
    """GPTDatasets for the named splits from `Data.<split>.dataset` (input_dir, split, max_seq_len).

    `num_samples` defaults to what the run draws (spec §2.4); `tokenizer` defaults to
    `Data.tokenizer` (else GPT-2) and must fit `Model.vocab_size`.
    """
    from gptforge.data.tokenizer import load_tokenizer

    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.Data.tokenizer)
    out: dict[str, GPTDataset] = {}
    opened: dict[Path, TokenFiles] = {}
    for mode in splits:
        if mode not in MODES:
            raise DataError(f"unknown split {mode!r}; expected one of {', '.join(MODES)}")
        ds_cfg = getattr(cfg.Data, mode).dataset
        prefix = resolve_prefix(_input_dir(cfg, mode), tok)
        if prefix not in opened:
            opened[prefix] = load_token_files(prefix)
            check_vocab(opened[prefix], tok, cfg.Model.vocab_size)
        files = opened[prefix]
        bounds = split_boundaries(ds_cfg.split, files.n_docs)
        k = MODES.index(mode)
        documents = np.arange(bounds[k], bounds[k + 1], dtype=np.int32)
        if len(documents) == 0:
            raise DataError(
                f"Data.{mode}.dataset.split: {list(ds_cfg.split)} leaves the {mode} split of {prefix.name} "
                f"({files.n_docs} documents) empty; give it a larger weight or use more documents"
            )
        n = default_num_samples(cfg, mode) if not num_samples or mode not in num_samples else int(num_samples[mode])
        try:
            out[mode] = GPTDataset(files, mode, documents, ds_cfg.max_seq_len, n, cfg.Global.seed)
        except DataError as e:
            raise DataError(f"Data.{mode} ({prefix.name}, documents {bounds[k]}..{bounds[k + 1]}): {e}") from None
    return out
