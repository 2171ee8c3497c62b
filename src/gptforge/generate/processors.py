"""Composable logits processors: each one maps (token history, scores) to new scores for one step.

A processor is any callable `p(input_ids, scores) -> scores`:
- `input_ids` [B, T] int64: every token so far (prompt + generated), left padding marked `NO_TOKEN`.
- `scores` [B, V] float32: next-token logits (or log-probabilities in beam search, as in HF).
Processors may modify `scores` in place and must return the tensor to use next. `ProcessorList`
chains them, so a user's own callables compose with the built-in ones.

Order used by `build_processors` + `build_warpers` (HF's order): repetition penalty →
min new tokens → padded-vocabulary mask → temperature → top-k → top-p. The last three
("warpers") apply only to sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

NO_TOKEN = -1  # history entries that hold no token (left padding of shorter prompts)

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ProcessorList(list):
    """Apply processors in order: `ProcessorList([a, b])(ids, scores) == b(ids, a(ids, scores))`."""

    @property
    def reads_ids(self) -> bool:
        """Whether any processor reads the history's token ids (not only its shape): a callable
        says it does not with `reads_ids = False`; the caller's own are assumed to read them."""
        return any(getattr(p, "reads_ids", True) for p in self)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for p in self:
            scores = p(input_ids, scores)
        return scores


class RepetitionPenalty:
    """Sign-aware penalty on every token already present (prompt included, padding excluded):
    a positive score is divided by `penalty`, a negative one multiplied, so >1 always discourages
    repeats (the CTRL rule, as HF `repetition_penalty`)."""

    def __init__(self, penalty: float):
        if penalty <= 0:
            raise ValueError(f"repetition penalty must be > 0, got {penalty}")
        self.penalty = float(penalty)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        B, V = scores.shape
        # Padding (and any id outside the logits) goes to a spare column that is then dropped.
        ids = torch.where((input_ids < 0) | (input_ids >= V), V, input_ids)
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=scores.device)
        seen.scatter_(1, ids, True)
        seen = seen[:, :V]
        penalised = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(seen, penalised, scores)


class MinNewTokens:
    """Forbid EOS until `min_new_tokens` tokens have been generated after the (padded) prompt."""

    reads_ids = False  # only the history's length

    def __init__(self, min_new_tokens: int, prompt_len: int, eos_token_ids: Sequence[int]):
        self.min_new_tokens = int(min_new_tokens)
        self.prompt_len = int(prompt_len)
        self.eos = list(eos_token_ids)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.eos and input_ids.shape[1] - self.prompt_len < self.min_new_tokens:
            for e in self.eos:  # a column at a time: indexing with the list costs ~4x
                scores[:, e] = float("-inf")
        return scores


class VocabLimit:
    """Never produce ids >= `limit`: the rows a vocabulary padded for speed (50257 → 50304) adds
    have no token behind them."""

    reads_ids = False  # only the history's length

    def __init__(self, limit: int):
        self.limit = int(limit)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[-1] > self.limit:
            scores[:, self.limit:] = float("-inf")
        return scores


class Temperature:
    """Divide the scores by `temperature` (> 0): < 1 sharpens, > 1 flattens."""

    reads_ids = False  # only the history's length

    def __init__(self, temperature: float):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.div_(self.temperature)


class TopK:
    """Keep the `k` highest scores (ties with the k-th are kept), set the rest to -inf."""

    reads_ids = False  # only the history's length

    def __init__(self, k: int, min_keep: int = 1):
        if k <= 0:
            raise ValueError(f"top_k must be > 0, got {k}")
        self.k = max(int(k), min_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[:, -1:]
        return scores.masked_fill_(scores < kth, float("-inf"))


class TopP:
    """Nucleus filter: keep the most likely tokens until their probability mass reaches `p`
    (the token that crosses `p` is kept). Probabilities are the softmax of the scores as they
    arrive, so after top-k they are renormalised over the surviving tokens (HF's behaviour)."""

    reads_ids = False  # only the history's length

    def __init__(self, p: float, min_keep: int = 1):
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        self.p = float(p)
        self.min_keep = int(min_keep)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.p >= 1.0:
            return scores
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly better tokens
        drop = mass_before >= self.p
        drop[:, : self.min_keep] = False
        remove = torch.zeros_like(drop).scatter_(1, order, drop)
        return scores.masked_fill_(remove, float("-inf"))


def argmax_mask(procs: ProcessorList, history_len: int) -> tuple[int | None, tuple[int, ...]] | None:
    """What `procs` leave of a greedy row's choices after `history_len` tokens when each of them
    only forbids columns (`VocabLimit`, `MinNewTokens`): (the column limit or None, the forbidden
    ids); None where another processor runs (the whole scores are then read)."""
    limit, banned = None, ()
    for p in procs:
        if type(p) is VocabLimit:
            limit = p.limit if limit is None else min(limit, p.limit)
        elif type(p) is MinNewTokens:
            if p.eos and history_len - p.prompt_len < p.min_new_tokens:
                banned += tuple(p.eos)
        else:
            return None
    return limit, banned


def build_processors(repetition_penalty: float, min_new_tokens: int, prompt_len: int,
                     eos_token_ids: Sequence[int], vocab_limit: int | None,
                     extra: Iterable[LogitsProcessor] = ()) -> ProcessorList:
    """Processors that apply to every strategy: repetition penalty, min new tokens, vocab mask,
    then the caller's own (`extra`)."""
    procs = ProcessorList()
    if repetition_penalty != 1.0:
        procs.append(RepetitionPenalty(repetition_penalty))
    if min_new_tokens > 0 and eos_token_ids:
        procs.append(MinNewTokens(min_new_tokens, prompt_len, eos_token_ids))
    if vocab_limit is not None:
        procs.append(VocabLimit(vocab_limit))
    procs.extend(extra)
    return procs


def build_warpers(temperature: float, top_k: int, top_p: float) -> ProcessorList:
    """Sampling-only filters: temperature, top-k, top-p (in that order)."""
    warpers = ProcessorList()
    if temperature != 1.0:
        warpers.append(Temperature(temperature))
    if top_k > 0:
        warpers.append(TopK(top_k))
    if top_p < 1.0:
        warpers.append(TopP(top_p))
    return warpers
