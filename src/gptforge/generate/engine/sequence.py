"""Requests, their sequences, and the events the engine sends back.

A `Request` holds `len(prompts) * params.n` sequences; choice index = prompt index * n + j.
Events go to the request's `sink` (called on the engine's thread): a `TokenEvent` per token,
then one `FinishEvent` per sequence.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from gptforge.generate.backend import prefill_chunks
from gptforge.generate.engine.params import SamplingParams


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 429)."""


class ShuttingDown(Exception):
    """The engine is draining and accepts no new requests (HTTP 503)."""


@dataclass
class TokenEvent:
    index: int  # choice index within the request
    token_id: int
    text: str  # new text that is final (may be "" while a character or a stop string is pending)
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    eos: bool = False  # the end-of-text token (no text; not listed in logprobs)


@dataclass
class FinishEvent:
    index: int
    reason: str  # stop | length | abort | error
    text: str  # the last piece of text not yet sent
    completion_tokens: int  # tokens generated (a final EOS included)
    error: str | None = None


class Request:
    """One client request: `len(prompts) * params.n` sequences (`n` overrides `params.n`)."""

    _ids = itertools.count()

    def __init__(self, prompts: Seq[Seq[int]], params: SamplingParams, n: int | None = None,
                 sink: Callable[[object], None] | None = None, keep_scores: bool = True):
        """`keep_scores`: sum each sequence's chosen log-probs (`Sequence.logprob_sum`, the scores
        of offline results); a server that never reports them turns it off (`params.logprobs`
        still gets its log-probs)."""
        self.id = next(Request._ids)
        self.keep_scores = keep_scores
        self.prompts = [list(p) for p in prompts]
        self.params = params
        self.n = int(n if n is not None else params.n)
        self.sink = sink or (lambda ev: None)
        self.cancelled = False
        self.arrived = time.perf_counter()
        self.open = len(self.prompts) * self.n


class Sequence:
    """One sequence's decoding state: its tokens, KV slots, sampling state and text."""

    def __init__(self, req: Request, index: int, prompt: list[int]):
        self.req, self.index, self.prompt = req, index, prompt
        self.params = req.params
        self.need = len(prompt) + self.params.max_tokens  # KV positions it may hold
        self.chunks = prefill_chunks(len(prompt))  # prompt chunks not yet prefilled
        self.generated: list[int] = []
        self.logprob_sum = 0.0  # of the chosen tokens under the processed distribution
        self.slot = None  # the target's KV slot while running
        self.dslot = None  # the draft's, with speculative decoding
        self.spec = False  # decodes in speculative rounds
        self.k = 0  # draft tokens per round (adapts with `auto`)
        self.sampling = None  # the sampler's per-sequence state (processors, warpers, generator)
        self.text_state = None  # the output processor's per-sequence state
        self.first_time = 0.0
        self.last_time = 0.0
        self.done = False
        self.finish_reason: str | None = None

    @property
    def prefilling(self) -> bool:
        return bool(self.chunks)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.generated)
