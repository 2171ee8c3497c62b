"""Speculative decoding inside the engine's step: a proposer (the draft model's slots) and a
verifier (the acceptance rules of `generate.speculative`).

Each step, every decoding sequence with a draft runs K ragged draft steps (one proposed token
per sequence each; the draft's prompt chunks ride along in the first), then the target step
feeds it `[last, d1..dK]` with logits at every position. The verifier accepts a prefix (greedy:
while the draft equals the target's argmax; sampling: speculative sampling with rejection, so
the output follows the target's processed distribution), the engine emits the accepted tokens
and the target's own one by one exactly as plain decoding does, and both slots roll back to
what the sequence holds. Proposal and verification scores come from the engine's `Sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptforge.generate.engine.runner import Work, run_step
from gptforge.generate.engine.sampler import Sampler
from gptforge.generate.spec_stats import SpeculativeStats, record
from gptforge.generate.speculative import (
    accept_greedy,
    accept_sampling,
    align_draft_logits,
    next_k,
    parse_num_draft_tokens,
)


@dataclass
class SpecStats:
    """What speculative decoding did: rounds (sequence-rounds verified), draft tokens proposed and
    accepted, and each round's K."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    k_history: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)  # sampled rows: the draft's distributions


class Speculator:
    """The draft side of the engine (see the module docstring)."""

    def __init__(self, draft_slots, num_draft_tokens, sampler: Sampler, vocab_size: int, device,
                 draft_max_positions: int, metrics=None, guard=None, on_error=None):
        self.slots = draft_slots
        self.k0, self.adaptive = parse_num_draft_tokens(num_draft_tokens)
        self.sampler = sampler
        self.vocab_size, self.device = vocab_size, device
        self.max_positions = draft_max_positions
        self.metrics = metrics
        # guard(compute, items): runs one step's proposals, ending only the sequences that fail
        self.guard = guard or (lambda compute, items: compute(items))
        self.on_error = on_error or (lambda: None)  # () -> the handler of one row's failed draw, or None
        self.stats = SpecStats()

    def admit(self, seq) -> None:
        """A sequence longer than the draft's context decodes plainly."""
        seq.spec = seq.need <= self.max_positions
        seq.k = self.k0
        if seq.spec:
            seq.dslot = self.slots.new_slot(seq.need)

    def propose(self, decoding, prefill) -> dict:
        """Draft tokens for every decoding sequence that can take some this step (K never runs
        past its max_tokens: the last token is the target's own); the draft's copies of this
        step's prompt chunks ride along."""
        props = {s: Proposal() for s in decoding if s.spec and min(s.k, s.remaining - 1) > 0}
        ks = {s: min(s.k, s.remaining - 1) for s in props}
        chunks = [Work(s, s.prompt[a:b], a, False) for s, a, b in prefill if s.spec]
        for i in range(max(list(ks.values()) + [1 if chunks else 0])):
            works = []
            for s, p in props.items():
                if i == 0:  # the draft catches up: the last token, and the K-th draft if all were kept
                    works.append(Work(s, s.tokens[s.dslot.length:], s.dslot.length, True))
                elif ks[s] > i:
                    works.append(Work(s, [p.tokens[-1]], s.dslot.length, True))
            outs = run_step(self.slots, works + (chunks if i == 0 else []), draft=True)[:len(works)]
            if not works:
                break
            logits = align_draft_logits(torch.stack(outs), self.vocab_size, self.device)
            items = [(w.seq, props[w.seq].tokens, row) for w, row in zip(works, logits, strict=True)]
            for (s, _, _), drawn in zip(items, self.guard(self._draw, items), strict=True):
                if drawn is None:  # it failed (and has been ended): out of the round
                    del props[s]
                    continue
                props[s].tokens.append(drawn[0])
                if drawn[1] is not None:
                    props[s].q.append(drawn[1])
        return props

    def _draw(self, items: list) -> list[tuple[int, torch.Tensor | None]]:
        """(draft token, its distribution q when sampled) per (sequence, drafts so far, logits)."""
        rows = [(s, toks) for s, toks, _ in items]
        scored = self.sampler.score(rows, torch.stack([row for _, _, row in items]))
        toks = self.sampler.choose(rows, scored, self.on_error())
        return [None if tok is None else (tok, scored.probs[r] if s.sampling.warpers is not None else None)
                for r, ((s, _), tok) in enumerate(zip(rows, toks, strict=True))]

    def verify(self, items: list[tuple[object, torch.Tensor, Proposal]]) -> list[tuple[list[int], torch.Tensor]]:
        """Per (sequence, target logits [k+1, V], proposal): the tokens to emit (accepted drafts +
        the target's own) and the log-probs [k+1, V] they were chosen from."""
        rows = [(s, p.tokens[:i]) for s, _, p in items for i in range(len(p.tokens) + 1)]
        scored = self.sampler.score(rows, torch.cat([t for _, t, _ in items]))
        logp = scored.logprobs()
        out, o, on_error = [], 0, self.on_error()
        for s, _, p in items:
            k = len(p.tokens)
            P = scored.scores[o:o + k + 1]
            try:
                d = torch.tensor([p.tokens], dtype=torch.long, device=P.device)
                if s.sampling.warpers is None:
                    acc, E = accept_greedy(d, P.argmax(-1)[None])
                else:
                    acc, E = accept_sampling(d, scored.probs[o:o + k + 1][None], torch.stack(p.q)[None],
                                             s.sampling.generator)
            except Exception as e:  # noqa: BLE001 - one row's failed draw ends that row (random draws never repeat)
                if on_error is None:
                    raise
                on_error(s, e)
                out.append(None)
                o += k + 1
                continue
            acc = int(acc[0])
            self._count(s, k, acc)
            out.append((E[0, :acc + 1].tolist(), logp[o:o + k + 1]))
            o += k + 1
        return out

    def _count(self, s, k: int, acc: int) -> None:
        st = self.stats
        st.rounds += 1
        st.drafted += k
        st.accepted += acc
        st.k_history.append(k)
        record(SpeculativeStats(rounds=1, drafted=k, accepted=acc))  # `collect_stats()` blocks (the CLI's report)
        hook = getattr(self.metrics, "on_draft", None)
        if hook is not None:
            hook(k, acc)
        if self.adaptive:
            s.k = next_k(s.k, acc == k)

    @staticmethod
    def rollback(s) -> None:
        """Keep what `s` holds: the target fed `last` and the kept drafts (not the new last
        token); the draft never saw d_k, so it keeps at most what it fed."""
        total = len(s.prompt) + len(s.generated)
        s.slot.truncate(total - 1)
        if s.dslot is not None:
            s.dslot.truncate(min(s.dslot.length, total - 1))
