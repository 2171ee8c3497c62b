"""The scheduler: bookkeeping only (no tensors). It keeps the bounded waiting queue and the
running batch, admits sequences by batch size and KV positions in flight, drops cancelled ones
and decides what each step computes:

- every running sequence past its prompt decodes (one token, or one speculative round);
- prompt chunks (`prefill_chunks`: fixed 32-token cuts, so a prompt's keys/values are the same
  whoever shares the step) of sequences still being prefilled, oldest first, up to
  `prefill_tokens` tokens in all; a sequence may take several chunks in one step.

Fairness to newcomers: admission is first come, first served, and the prefill budget goes to
the oldest prompts first, so a new request's first token waits for the prompts ahead of it, not
for the running sequences to finish; `decode_only_steps` bounds how many steps in a row may run
without prefill work while prompts are waiting in the batch (with the default budget every step
carries prefill work when there is any).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gptforge.generate.backend import PREFILL_CHUNK
from gptforge.generate.engine.sequence import QueueFull, Sequence


@dataclass
class SchedulerConfig:
    max_batch_size: int = 16  # sequences decoded together
    max_tokens_in_flight: int | None = None  # KV positions (prompt + max_tokens) reserved; None: batch x context
    max_queue: int = 256  # sequences waiting before `add` raises QueueFull
    prefill_tokens: int = 16 * PREFILL_CHUNK  # prompt tokens per step beside the decodes (newcomers' first tokens)


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)  # one token (or a speculative round) each
    prefill: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (sequence, start, end) chunks

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    """Waiting queue + running batch (see the module docstring)."""

    def __init__(self, cfg: SchedulerConfig, max_positions: int):
        if cfg.prefill_tokens < PREFILL_CHUNK:
            raise ValueError(f"prefill_tokens must be >= {PREFILL_CHUNK} (one prompt chunk), got {cfg.prefill_tokens}")
        self.cfg = cfg
        self.max_tokens_in_flight = max(cfg.max_tokens_in_flight or cfg.max_batch_size * max_positions,
                                        max_positions)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0
        self.peak_batch = 0

    def add(self, seqs: list[Sequence], bounded: bool = True) -> None:
        """Queue sequences; `QueueFull` if the bound would be passed (`bounded`)."""
        if bounded and len(self.waiting) + len(seqs) > self.cfg.max_queue:
            raise QueueFull(f"the request queue is full ({self.cfg.max_queue} sequences waiting); retry later")
        self.waiting.extend(seqs)

    def drop_cancelled(self) -> list[Sequence]:
        """Remove sequences of cancelled requests (running and waiting); returns the running ones."""
        gone = [s for s in self.running if s.req.cancelled or s.done]
        for s in gone:
            self.release(s)
        if any(s.req.cancelled for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.req.cancelled)
        return gone

    def admit(self, on_admit: Callable[[Sequence], bool]) -> list[Sequence]:
        """Move waiting sequences into the batch while it has room; `on_admit` gives each its slots
        (False: it could not start)."""
        new = []
        while self.waiting and len(self.running) < self.cfg.max_batch_size:
            s = self.waiting[0]
            if s.req.cancelled or s.done:  # e.g. a sibling just failed to start
                self.waiting.popleft()
                continue
            if self.running and self.reserved + s.need > self.max_tokens_in_flight:
                break
            self.waiting.popleft()
            if not on_admit(s):  # it could not start (and has been ended)
                continue
            self.reserved += s.need
            self.running.append(s)
            new.append(s)
        self.peak_batch = max(self.peak_batch, len(self.running))
        return new

    def release(self, s: Sequence) -> None:
        """Take `s` out of the batch; its slots go with it."""
        if s in self.running:
            self.running.remove(s)
            self.reserved -= s.need
        s.slot = s.dslot = None

    def plan(self) -> StepPlan:
        """What the next step computes (see the module docstring); pops the chunks it takes."""
        plan = StepPlan(decode=[s for s in self.running if not s.chunks])
        budget = self.cfg.prefill_tokens
        for s in self.running:  # the oldest first: the batch keeps arrival order
            while s.chunks and s.chunks[0][1] - s.chunks[0][0] <= budget:
                a, b = s.chunks.pop(0)
                budget -= b - a
                plan.prefill.append((s, a, b))
            if budget < PREFILL_CHUNK:
                break
        return plan

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
