"""The sampler: processed scores, the next token (greedy or sampled) and log-probabilities, for
every client and for speculative proposals and verification alike: the one place where logits
become tokens.

Each sequence gets its processors (repetition penalty, min new tokens, vocabulary mask, the
caller's own), its warpers (temperature, top-k, top-p; sampling only) and its generator. Rows
are processed in groups that share processors and history length (one stacked call), which is
what a lone sequence computes: every processor and softmax works row by row.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from gptforge.generate.engine.params import SamplingParams
from gptforge.generate.processors import (
    NO_TOKEN,
    LogitsProcessor,
    ProcessorList,
    build_processors,
    build_warpers,
)
from gptforge.transforms import native_kernels

_BLOCK = 64


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of scores [R, V], the same indices (the first maximum; a NaN wins):
    torch's argmax reduction is not vectorized. On CPU, gptforge's kernel where it runs (a vector
    maximum, then the first index equal to it: ~0.1x argmax's time); else (or on other devices)
    the maximum of blocks of 64 columns through amax, the first block that holds the row's
    maximum, and the first index inside it (a row holding a NaN goes to argmax itself)."""
    R, V = x.shape
    if x.dtype == torch.float32 and x.device.type == "cpu" and V and native_kernels.unavailable() is None:
        return native_kernels.row_argmax(x)
    nb = V // _BLOCK
    if nb < 2 or x.dtype != torch.float32:
        return x.argmax(dim=-1)
    body = x[:, :nb * _BLOCK].reshape(R, nb, _BLOCK)
    bmax = body.amax(dim=-1)
    m = bmax.amax(dim=-1)
    tail = x[:, nb * _BLOCK:]
    if tail.shape[1]:
        m = torch.maximum(m, tail.amax(dim=-1))
    if torch.isnan(m).any():
        return x.argmax(dim=-1)
    hit = bmax == m[:, None]
    blk = hit.to(torch.uint8).argmax(dim=-1)  # the first block holding the maximum (0 if none does)
    inner = body[torch.arange(R, device=x.device), blk]
    idx = blk * _BLOCK + (inner == m[:, None]).to(torch.uint8).argmax(dim=-1)
    if tail.shape[1]:  # rows whose maximum is only in the last, partial block
        idx = torch.where(hit.any(dim=-1), idx, nb * _BLOCK + (tail == m[:, None]).to(torch.uint8).argmax(dim=-1))
    return idx


@dataclass
class SeqSampling:
    processors: ProcessorList
    warpers: ProcessorList | None  # None: greedy
    generator: torch.Generator | None  # None: torch's global RNG (or greedy)


@dataclass
class Scored:
    """Processed scores [R, V] (what greedy picks from and log-probs are taken of) and, for
    sampled rows, the sampling distribution [R, V] after the warpers (other rows: unused)."""

    scores: torch.Tensor
    probs: torch.Tensor | None

    def logprobs(self, rows: Seq[int] | None = None) -> torch.Tensor:
        """Log-probs of the processed scores: every row, or only `rows` (in that order; each row's
        values are the same either way: log_softmax works row by row)."""
        if rows is None or len(rows) == self.scores.shape[0]:
            return torch.log_softmax(self.scores, dim=-1)
        sel = torch.tensor(list(rows), dtype=torch.long, device=self.scores.device)
        return torch.log_softmax(self.scores.index_select(0, sel), dim=-1)


class Sampler:
    """Turns logits into tokens for sequences (see the module docstring)."""

    def __init__(self, eos_token_ids: Seq[int], vocab_limit: int | None, device,
                 extra: Seq[LogitsProcessor] = ()):
        self.eos = list(eos_token_ids)
        self.vocab_limit = vocab_limit
        self.device = device
        self.extra = list(extra)
        self._shared: dict[tuple, tuple[ProcessorList, ProcessorList | None]] = {}

    def setup(self, seq) -> None:
        """Give `seq` its processors, warpers and generator (once, when it is admitted)."""
        p: SamplingParams = seq.params
        key = (id(p), len(seq.prompt))
        if key not in self._shared:  # sequences of one request and prompt length share them (stacked calls)
            procs = build_processors(p.repetition_penalty, p.min_tokens, len(seq.prompt), self.eos,
                                     self.vocab_limit, self.extra)
            warpers = None if p.greedy else build_warpers(p.temperature or 1.0, max(p.top_k, 0), p.top_p)
            self._shared[key] = (procs, warpers)
        procs, warpers = self._shared[key]
        gen = None
        if not p.greedy and p.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(p.seed) + seq.index % seq.req.n)
        seq.sampling = SeqSampling(procs, warpers, gen)

    def forget(self, params: SamplingParams) -> None:
        """Drop the shared processors of a finished request."""
        for key in [k for k in self._shared if k[0] == id(params)]:
            del self._shared[key]

    def score(self, rows: Seq[tuple[object, Seq[int]]], logits: torch.Tensor) -> Scored:
        """Scores of `logits` [R, V]; row r belongs to sequence `rows[r][0]` whose history is its
        tokens followed by `rows[r][1]` (draft tokens being proposed or verified)."""
        logits = logits.float()
        groups: dict[tuple, list[int]] = {}
        for r, (seq, extra) in enumerate(rows):
            s = seq.sampling
            if not s.processors and s.warpers is None:
                key: tuple = ()  # greedy rows without processors (any request): their scores are the logits
            else:
                key = (id(s.processors), id(s.warpers), len(seq.prompt) + len(seq.generated) + len(extra))
            groups.setdefault(key, []).append(r)
        any_sampled = any(seq.sampling.warpers is not None for seq, _ in rows)
        whole = len(groups) == 1  # one group holds every row, in order: its results are the tensors
        if whole and not rows[0][0].sampling.processors:
            scores = logits
        else:
            scores = None if whole else torch.empty_like(logits)
        probs = torch.empty_like(logits) if any_sampled and not whole else None
        for key, idx in groups.items():
            s0 = rows[idx[0]][0].sampling
            hist = None
            if (s0.processors and s0.processors.reads_ids) or (s0.warpers and s0.warpers.reads_ids):
                hist = torch.tensor([rows[r][0].tokens + list(rows[r][1]) for r in idx], dtype=torch.long,
                                    device=logits.device)
            elif s0.processors or s0.warpers:  # they read only its length (the group's, by its key)
                hist = torch.full((1, 1), NO_TOKEN, dtype=torch.long, device=logits.device).expand(len(idx), key[2])
            if scores is logits and s0.warpers is None:
                continue  # one greedy group without processors: the scores are the logits (no copy)
            sel = None if whole else torch.tensor(idx, dtype=torch.long, device=logits.device)
            part = logits.clone() if whole else logits.index_select(0, sel)
            part = s0.processors(hist, part) if s0.processors else part
            if scores is None:
                scores = part
            elif scores is not logits:
                scores[sel] = part
            if s0.warpers is not None:
                p = s0.warpers(hist, part.clone()).softmax(dim=-1)
                if whole:
                    probs = p
                else:
                    probs[sel] = p
        return Scored(scores, probs)

    def choose(self, rows: Seq[tuple[object, Seq[int]]], scored: Scored, on_error=None) -> list[int | None]:
        """The next token of every row: the argmax (greedy) or a draw from its distribution with
        the sequence's generator. With `on_error(seq, exc)`, a row whose draw fails gets None (the
        other rows' draws are made once, as alone); without, the failure propagates."""
        best = row_argmax(scored.scores).tolist()
        out: list[int | None] = []
        for r, (seq, _) in enumerate(rows):
            s = seq.sampling
            if s.warpers is None:
                out.append(int(best[r]))
                continue
            try:
                out.append(int(torch.multinomial(scored.probs[r:r + 1], 1, generator=s.generator)))
            except Exception as e:  # noqa: BLE001 - e.g. a nan distribution: this row's failure
                if on_error is None:
                    raise
                on_error(seq, e)
                out.append(None)
        return out
