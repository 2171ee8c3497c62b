"""Greedy and sampling decode loops over a `StepBackend`, and the batch/result types they share.

Prompts of different lengths are left-padded: every row's last prompt token sits in the same
column, so one decode step serves the whole batch. Padding is hidden by the attention mask and
positions count real tokens only (`cumsum(mask) - 1`, as HF), so a padded row computes exactly
what it would alone. A row that emits EOS is finished: later steps write the pad id into it,
and the loop ends when every row is finished (`early_finish`) or after `max_new_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from gptforge.generate.processors import NO_TOKEN, ProcessorList


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

    def sequences(self, keep_eos: bool = False) -> list[list[int]]:
        """Token-id lists per row, without padding (and without the final EOS unless `keep_eos`)."""
        out = []
        for row, n, fin in zip(self.tokens.tolist(), self.lengths.tolist(), self.finished.tolist(), strict=True):
            out.append(row[: n if keep_eos or not fin else n - 1])
        return out


def choose_next(history: torch.Tensor, logits: torch.Tensor, processors: ProcessorList, warpers: ProcessorList,
                greedy: bool, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row ([B]) and the log-probabilities [B, V] of the processed
    distribution (before the sampling filters) it was chosen from. Shared by `TokenDecoder`
    and `gptforge serve`'s scheduler, which calls it one row at a time."""
    scores = processors(history, logits)
    logp = torch.log_softmax(scores, dim=-1)
    if greedy:
        nxt = scores.argmax(dim=-1)
    else:
        probs = warpers(history, scores).softmax(dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return nxt, logp


class TokenDecoder:
    """Greedy or sampling decoding, one step per iteration: iterating yields the tokens chosen
    at each step ([N] tensor, pad for finished rows); `output()` gives the result so far.

    Scores are the mean log-probability of each row's tokens (EOS included) under the processed
    distribution before the sampling filters (temperature, top-k, top-p), as the reference.
    """

    def __init__(self, backend, prompts: PromptBatch, *, max_new_tokens: int, greedy: bool,
                 processors: ProcessorList, warpers: ProcessorList | None = None,
                 generator: torch.Generator | None = None, eos_token_ids: Sequence[int] = (),
                 pad_token_id: int = 0, num_return_sequences: int = 1, early_finish: bool = True):
        self.backend, self.prompts = backend, prompts
        self.max_new = int(max_new_tokens)
        self.greedy = greedy
        self.processors = processors
        self.warpers = warpers or ProcessorList()
        self.generator = generator
        self.eos = list(eos_token_ids)
        self.pad = int(pad_token_id)
        self.n = int(num_return_sequences)
        self.early_finish = early_finish
        N = prompts.batch_size * self.n
        dev = backend.device
        with torch.inference_mode():  # updated in place inside the loop's inference mode
            self.tokens = torch.full((N, self.max_new), self.pad, dtype=torch.long, device=dev)
            self.lengths = torch.zeros(N, dtype=torch.long, device=dev)
            self.finished = torch.zeros(N, dtype=torch.bool, device=dev)
            self.score_sum = torch.zeros(N, dtype=torch.float32, device=dev)
        self.steps = 0

    def _pick(self, history: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nxt, logp = choose_next(history, logits, self.processors, self.warpers, self.greedy, self.generator)
        return nxt, logp.gather(1, nxt[:, None]).squeeze(1)

    def __iter__(self) -> Iterator[torch.Tensor]:
        p, be = self.prompts, self.backend
        B, L, N = p.batch_size, p.length, p.batch_size * self.n
        total = L + self.max_new
        dev = be.device
        with torch.inference_mode():
            cache = be.new_cache(B, total)
            logits = be.step(p.input_ids, p.position_ids, p.attention_mask, cache)
            if self.n > 1:  # prefill once per prompt, then copy its cache to the n samples
                rows = torch.arange(B, device=dev).repeat_interleave(self.n)
                cache = be.reorder(cache, rows)
                logits = logits.index_select(0, rows)
            hist = torch.full((N, total), NO_TOKEN, dtype=torch.long, device=dev)
            hist[:, :L] = p.history.repeat_interleave(self.n, 0)
            mask = p.full_mask(N, total, dev)
            pos = p.position_ids[:, -1:].repeat_interleave(self.n, 0) + 1
            alive = torch.ones(N, dtype=torch.bool, device=dev)
            eos = torch.tensor(self.eos, dtype=torch.long, device=dev)
        for t in range(self.max_new):
            with torch.inference_mode():
                nxt, logp = self._pick(hist[:, : L + t], logits)
                nxt = torch.where(alive, nxt, self.pad)
                self.score_sum += torch.where(alive, logp, 0.0)
                self.lengths += alive
                hist[:, L + t] = nxt
                self.tokens[:, t] = nxt
                hit = alive & torch.isin(nxt, eos)
                self.finished |= hit
                alive &= ~hit
                self.steps = t + 1
            yield nxt
            if t == self.max_new - 1 or (self.early_finish and not bool(alive.any())):
                break
            with torch.inference_mode():
                step_mask = mask[:, : L + t + 1] if mask is not None else None
                logits = be.step(nxt[:, None], pos, step_mask, cache)
                pos = pos + 1

    def run(self) -> SearchOutput:
        for _ in self:
            pass
        return self.output()

    def output(self) -> SearchOutput:
        scores = self.score_sum / self.lengths.clamp_min(1)
        return SearchOutput(self.tokens[:, : self.steps].cpu(), self.lengths.cpu(), self.finished.cpu(), scores.cpu())
