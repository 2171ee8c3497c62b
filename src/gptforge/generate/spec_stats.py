"""What speculative decoding did, for the user: `SpeculativeStats` (read-only) and a way to sum
them over the decoders that `generate()` / `stream()` build themselves (`collect_stats`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeStats:
    """Draft/verify rounds, draft tokens proposed (per live row) and accepted. `gptforge
    generate/infer` report them; a rewritten decode loop must keep filling them."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def __add__(self, other: SpeculativeStats) -> SpeculativeStats:
        return SpeculativeStats(self.rounds + other.rounds, self.drafted + other.drafted,
                                self.accepted + other.accepted)

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": self.acceptance_rate}


class StatsTotal:
    """The running sum of the rounds run inside `collect_stats()`."""

    def __init__(self) -> None:
        self.stats = SpeculativeStats()


_TOTAL: contextvars.ContextVar[StatsTotal | None] = contextvars.ContextVar("gptforge_speculative", default=None)


@contextlib.contextmanager
def collect_stats() -> Iterator[StatsTotal]:
    """Sum the rounds of every speculative decoder that runs inside the block (in this context)."""
    total = StatsTotal()
    token = _TOTAL.set(total)
    try:
        yield total
    finally:
        _TOTAL.reset(token)


def record(round_stats: SpeculativeStats) -> None:
    """Add one round to the enclosing `collect_stats()` block, if any."""
    total = _TOTAL.get()
    if total is not None:
        total.stats += round_stats
