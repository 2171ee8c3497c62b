"""Tokenized instruction examples → fixed-length training rows, packed or padded.

An example is ids + a learned-token mask (data/chat_template.py). A row holds `seq_len`
positions: `tokens` (inputs), `labels` (the next ids), `loss_mask` (1 where the next id is
learned), `position_ids` and `segments`. Packing puts several whole examples into one row
(first fit, in the shuffled order); positions restart at 0 for each example and
`segments` numbers the examples of the row (1, 2, ...; padding is 0), from which
`packed_attention_mask` builds the block-diagonal causal mask, so no token attends across
examples and the loss equals the unpacked loss (tests/test_sft_packing.py). Without packing a
row holds one example, padded.

Examples longer than a row are dropped, not truncated: a truncated answer would teach the model
never to reach EOS. The count is reported.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from gptforge.data.chat_template import Encoded

IGNORE = -100


@dataclass
class Rows:
    """Packed rows as [N, seq_len] arrays (the trainer's batch keys) and what packing did."""

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    position_ids: np.ndarray
    segments: np.ndarray
    examples: int
    dropped: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __getitem__(self, i: int) -> dict:
        return {"tokens": self.tokens[i], "labels": self.labels[i], "loss_mask": self.loss_mask[i],
                "position_ids": self.position_ids[i], "segments": self.segments[i]}

    @property
    def fill(self) -> float:
        """The fraction of positions that hold tokens (not padding)."""
        return float((self.segments > 0).mean()) if len(self) else 0.0


def _place(lengths: list[int], seq_len: int, packing: bool) -> list[list[int]]:
    """Example indices per row: first fit over open rows (one example per row without packing)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths):
        if packing:
            for r, room in enumerate(free):
                if n <= room:
                    rows[r].append(i)
                    free[r] -= n
                    break
            else:
                rows.append([i])
                free.append(seq_len - n)
        else:
            rows.append([i])
    return rows


def build_rows(examples: list[Encoded], seq_len: int, packing: bool = True, seed: int = 0,
               epochs: int = 1) -> Rows:
    """Rows for `epochs` passes over `examples`, each pass in its own seeded order."""
    kept = [e for e in examples if 2 <= len(e.ids) <= seq_len + 1]
    dropped = len(examples) - len(kept)
    order: list[int] = []
    for ep in range(epochs):
        perm = list(range(len(kept)))
        random.Random(seed + ep).shuffle(perm)
        order += perm
    lengths = [len(kept[i].ids) - 1 for i in order]
    layout = _place(lengths, seq_len, packing)
    n = len(layout)
    tokens = np.zeros((n, seq_len), np.int64)
    labels = np.full((n, seq_len), IGNORE, np.int64)
    mask = np.zeros((n, seq_len), np.float32)
    pos = np.zeros((n, seq_len), np.int64)
    seg = np.zeros((n, seq_len), np.int64)
    for r, members in enumerate(layout):
        at = 0
        for s, j in enumerate(members, 1):
            e = kept[order[j]]
            k = len(e.ids) - 1
            tokens[r, at:at + k] = e.ids[:-1]
            labels[r, at:at + k] = e.ids[1:]
            mask[r, at:at + k] = e.mask[1:]
            pos[r, at:at + k] = np.arange(k)
            seg[r, at:at + k] = s
            at += k
    return Rows(tokens, labels, mask, pos, seg, examples=len(kept), dropped=dropped)


def packed_attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: query t sees key s when s <= t and both lie in the same example
    (padding, segment 0, sees only padding, so no row of the softmax is empty)."""
    T = segments.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]


def encode_plain(tokenizer, prompt: str, completion: str, train_on_inputs: bool = False) -> Encoded:
    """Plain-text prompt + completion + EOS; the completion and EOS are learned. The two parts are
    tokenized apart, as a prompt is at inference."""
    p, c = tokenizer.encode(prompt), tokenizer.encode(completion) + [tokenizer.eos_token_id]
    return Encoded(p + c, [int(train_on_inputs)] * len(p) + [1] * len(c))


# The row length examples are re-packed into within a step (at least the batch's longest row):
# long enough that short examples share rows, short enough that a row's block-diagonal
# attention wastes little on masked-out pairs.
REPACK_ROW = 128
_PAD = {"labels": IGNORE}


def _examples(segments: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, length) of every example (a run of one non-zero segment id) of the rows."""
    out = []
    for r, row in enumerate(segments.tolist()):
        start = 0
        for t in range(1, len(row) + 1):
            if t == len(row) or row[t] != row[start]:
                if row[start]:
                    out.append((r, start, t - start))
                start = t
    return out


def compact_batch(batch: dict, keep: float = 0.85) -> dict:
    """The batch's examples in fewer positions: the same tokens, labels, loss weights, positions
    and per-example attention, so the same loss and gradients, without computing padding.

    Examples are re-packed first-fit-decreasing into rows of max(longest example, REPACK_ROW
    capped at the row length) positions when that needs at most `keep` of the positions the
    rows have up to their last token, or no more of them in shorter rows (a row's
    block-diagonal attention costs in proportion to its length per token); otherwise the rows
    are only cut after their last token (every position there is padding: it carries no loss
    and no example attends to it)."""
    seg = batch["segments"]
    B, T = seg.shape
    ex = _examples(seg.cpu())
    if not ex:
        return batch
    used = max(s + n for _, s, n in ex)
    cap = max(max(n for _, _, n in ex), min(T, REPACK_ROW))
    bins: list[list[tuple[int, int, int]]] = []
    room: list[int] = []
    for e in sorted(ex, key=lambda e: -e[2]):
        i = next((i for i, free in enumerate(room) if free >= e[2]), None)
        if i is None:
            bins.append([])
            room.append(cap)
            i = len(bins) - 1
        bins[i].append(e)
        room[i] -= e[2]
    positions = len(bins) * cap
    if positions > keep * B * used and not (cap < used and positions <= B * used):
        return batch if used == T else {k: v[:, :used] if _rowwise(v, B, T) else v for k, v in batch.items()}
    src = torch.full((len(bins), cap), -1, dtype=torch.long)
    new_seg = torch.zeros((len(bins), cap), dtype=seg.dtype)
    for b, members in enumerate(sorted(bins, key=lambda m: min(m))):  # in the batch's order, for determinism
        at = 0
        for k, (r, s, n) in enumerate(sorted(members), 1):
            src[b, at:at + n] = torch.arange(r * T + s, r * T + s + n)
            new_seg[b, at:at + n] = k
            at += n
    live = (src >= 0).to(seg.device)
    idx = src.clamp(min=0).to(seg.device)
    out = {}
    for k, v in batch.items():
        if not _rowwise(v, B, T):
            out[k] = v
            continue
        out[k] = torch.where(live, v.reshape(-1)[idx], torch.as_tensor(_PAD.get(k, 0), dtype=v.dtype, device=v.device))
    out["segments"] = new_seg.to(seg.device)
    return out


def _rowwise(v, B: int, T: int) -> bool:
    return isinstance(v, torch.Tensor) and tuple(v.shape) == (B, T)
