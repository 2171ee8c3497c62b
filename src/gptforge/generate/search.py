"""The left-padded prompt batch beam search runs on, and the result type of every decode.

Prompts of different lengths are left-padded: every row's last prompt token sits in the same
column, so one decode step serves the whole batch. Padding is hidden by the attention mask and
positions count real tokens only (`cumsum(mask) - 1`, as HF), so a padded row computes exactly
what it would alone. (Greedy and sampling run the engine, `generate.engine`, with no padding.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gptforge.generate.processors import NO_TOKEN


@dataclass
class PromptBatch:
    """Left-padded prompts. `attention_mask` is None when no row needed padding."""

    input_ids: torch.Tensor  # [B, L], padding = pad id
    position_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor | None  # [B, L], 1 = real token
    history: torch.Tensor  # [B, L], padding = NO_TOKEN (what processors see)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def full_mask(self, rows: int, total: int, device) -> torch.Tensor | None:
        """[rows, total] mask with the prompt columns filled and every later column visible."""
        if self.attention_mask is None:
            return None
        mask = torch.ones(rows, total, dtype=self.attention_mask.dtype, device=device)
        rep = rows // self.batch_size
        mask[:, : self.length] = self.attention_mask.repeat_interleave(rep, 0)
        return mask


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int, device=None) -> PromptBatch:
    """Pack token-id lists into a left-padded `PromptBatch` on `device`."""
    lens = [len(p) for p in prompts]
    B, L = len(prompts), max(lens)
    ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    hist = torch.full((B, L), NO_TOKEN, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompts):
        if lens[i]:
            row = torch.as_tensor(list(p), dtype=torch.long)
            ids[i, L - lens[i]:] = row
            hist[i, L - lens[i]:] = row
            mask[i, L - lens[i]:] = 1
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    padded = min(lens) != L
    return PromptBatch(ids.to(device), pos.to(device), mask.to(device) if padded else None, hist.to(device))


@dataclass
class SearchOutput:
    """Generated continuations, `num_return_sequences` consecutive rows per prompt."""

    tokens: torch.Tensor  # [N, T] generated ids; after a row's end: pad id
    lengths: torch.Tensor  # [N] generated tokens per row (a final EOS included)
    finished: torch.Tensor  # [N] bool: the row ended with EOS (else it hit max_new_tokens)
    scores: torch.Tensor  # [N] float: mean log-prob (greedy/sampling) or beam score
    speculative: object = None  # with a draft model: its `SpecStats` (rounds, drafted, accepted, rate)
    texts: list[str] | None = None  # with stop strings: each row's text, cut before the stop string
    stopped: list[bool] | None = None  # with stop strings: the row ended at one

    def sequences(self, keep_eos: bool = False) -> list[list[int]]:
        """Token-id lists per row, without padding (and without the final EOS unless `keep_eos`)."""
        out = []
        for row, n, fin in zip(self.tokens.tolist(), self.lengths.tolist(), self.finished.tolist(), strict=True):
            out.append(row[: n if keep_eos or not fin else n - 1])
        return out

    @classmethod
    def from_sequences(cls, seqs, eos: Sequence[int], pad: int, width: int | None = None,
                       speculative=None) -> SearchOutput:
        """The output of finished engine sequences (a final EOS counts in `lengths`); `width`
        pads the token matrix to that many columns (default: the longest row)."""
        eos = set(eos)
        lens = [len(s.generated) for s in seqs]
        W = max([width or 0, *lens, 0])
        tokens = torch.full((len(seqs), W), pad, dtype=torch.long)
        for r, s in enumerate(seqs):
            if s.generated:
                tokens[r, :lens[r]] = torch.tensor(s.generated, dtype=torch.long)
        finished = torch.tensor([bool(s.generated) and s.generated[-1] in eos for s in seqs], dtype=torch.bool)
        scores = torch.tensor([s.logprob_sum / max(n, 1) for s, n in zip(seqs, lens, strict=True)],
                              dtype=torch.float32)
        return cls(tokens, torch.tensor(lens, dtype=torch.long), finished, scores, speculative)

    @classmethod
    def concat(cls, outs: Sequence[SearchOutput], pad: int) -> SearchOutput:
        """Rows of several outputs, one after another (token matrices padded to one width)."""
        if len(outs) == 1:
            return outs[0]
        W = max(int(o.tokens.shape[1]) for o in outs)
        toks = [torch.nn.functional.pad(o.tokens, (0, W - o.tokens.shape[1]), value=pad) for o in outs]
        return cls(torch.cat(toks), torch.cat([o.lengths for o in outs]), torch.cat([o.finished for o in outs]),
                   torch.cat([o.scores for o in outs]))
