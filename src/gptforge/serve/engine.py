"""The continuous-batching scheduler of `gptforge serve`: one thread that owns the running batch.

Every iteration (one model step):
1. drops cancelled requests and admits waiting sequences while the batch has room
   (`max_batch_size` sequences, `max_tokens_in_flight` reserved KV positions = prompt + max_tokens
   of every running sequence); each admitted sequence gets its own KV slot, sized for it;
2. builds one ragged step: one decode token for every sequence past its prompt, plus prompt
   chunks (`prefill_chunks`, at most `prefill_tokens` tokens in all) of sequences still being
   prefilled, so a new prompt never stalls the running streams for longer than one chunk;
3. picks each sequence's next token with its own processors and generator (the code of
   `generate`: `choose_next`), streams the text, and finishes sequences on EOS, a stop string
   or max_tokens: a finished sequence leaves the batch and frees its slot at once.

With a draft model (`Generation.draft`), sequences decode in speculative rounds inside the
same loop (`_spec_step`): each step runs up to K ragged draft steps (one proposed token per
sequence each; the draft's prompt chunks ride along with the target's), then ONE target step
in which every sequence's segment is `[last, d1..dK]` with logits at every position; each
sequence accepts by the rules of `generate.speculative` (shared functions), both of its slots
roll back to the accepted length, and the accepted tokens go out one by one exactly as plain
decoding emits them (EOS, stop strings, max_tokens, logprobs).

Requests talk to the engine through `submit` / `cancel` (any thread) and receive `TokenEvent`
and `FinishEvent`s through the `sink` callable they pass (called on the engine thread).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from gptforge.config.schema import GenerationConfig
from gptforge.generate.api import IncrementalDecoder
from gptforge.generate.backend import PREFILL_CHUNK, prefill_chunks
from gptforge.generate.processors import build_processors, build_warpers
from gptforge.generate.search import choose_next
from gptforge.generate.slots import Segment
from gptforge.generate.speculative import (
    accept_greedy,
    accept_sampling,
    align_draft_logits,
    next_k,
    parse_num_draft_tokens,
)


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 429)."""


class ShuttingDown(Exception):
    """The engine is draining and accepts no new requests (HTTP 503)."""


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None  # choice i samples with seed + i
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k: the chosen token's log-prob and the k best

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    """One API request: `len(prompts) * n` sequences; choice index = prompt index * n + j."""

    _ids = itertools.count()

    def __init__(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int,
                 sink: Callable[[object], None]):
        self.id = next(Request._ids)
        self.prompts = [list(p) for p in prompts]
        self.params, self.n, self.sink = params, n, sink
        self.cancelled = False
        self.arrived = time.perf_counter()
        self.open = len(self.prompts) * n


class _Seq:
    def __init__(self, req: Request, index: int, prompt: list[int], engine: Engine):
        p = req.params
        self.req, self.index, self.prompt = req, index, prompt
        self.need = len(prompt) + p.max_tokens
        self.chunks = prefill_chunks(len(prompt))
        self.generated: list[int] = []
        self.slot = None
        gcfg = GenerationConfig(decode_strategy="greedy_search" if p.greedy else "sampling",
                                temperature=p.temperature or 1.0, top_k=max(p.top_k, 0), top_p=p.top_p,
                                repetition_penalty=p.repetition_penalty)
        self.processors = build_processors(gcfg, len(prompt), engine.eos, engine.vocab_limit)
        self.warpers = None if p.greedy else build_warpers(gcfg)
        self.generator = None
        if not p.greedy:
            self.generator = torch.Generator(device=engine.slots.device)
            if p.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(int(p.seed) + index % req.n)
        # Speculative decoding: the draft's slot, and this sequence's own K (adapts with `auto`).
        self.spec = engine.draft_slots is not None and self.need <= engine.draft_max_positions
        self.dslot = None
        self.k = engine.num_draft_tokens
        self.decoder = IncrementalDecoder(engine.tokenizer)
        self.text = ""  # decoded text so far
        self.sent = 0  # characters of `text` already sent
        self.last_time = 0.0
        self.done = False


class Engine:
    """Continuous batching over `slots` (`gptforge.generate.slots.slots_for(backend)`)."""

    def __init__(self, slots, tokenizer, *, eos_token_ids: Sequence[int], vocab_limit: int | None,
                 max_positions: int, max_batch_size: int = 16, max_tokens_in_flight: int | None = None,
                 max_queue: int = 256, prefill_tokens: int = PREFILL_CHUNK, metrics=None,
                 draft_slots=None, num_draft_tokens="5", draft_max_positions: int | None = None):
        if prefill_tokens < PREFILL_CHUNK:
            raise ValueError(f"prefill_tokens must be >= {PREFILL_CHUNK} (one prompt chunk), got {prefill_tokens}")
        self.slots, self.tokenizer = slots, tokenizer
        self.eos = list(eos_token_ids)
        self.vocab_limit = vocab_limit
        self.max_positions = max_positions
        self.max_batch_size = max_batch_size
        self.max_tokens_in_flight = max(max_tokens_in_flight or max_batch_size * max_positions, max_positions)
        self.max_queue = max_queue
        self.prefill_tokens = prefill_tokens
        self.metrics = metrics
        # `draft_slots`: `slots_for(draft backend)`; the target's slots must be ragged (verification
        # needs the logits of every position). A sequence longer than the draft's context decodes plainly.
        if draft_slots is not None and not getattr(slots, "ragged", False):
            raise ValueError("speculative decoding needs ragged target slots (logits of every position)")
        self.draft_slots = draft_slots
        self.num_draft_tokens, self.adaptive = (parse_num_draft_tokens(num_draft_tokens) if draft_slots is not None
                                                else (0, False))
        self.draft_max_positions = draft_max_positions or max_positions
        self.drafted = 0  # draft tokens proposed / accepted by the target, over all sequences
        self.accepted = 0
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._reserved = 0
        self._cv = threading.Condition()
        self._draining = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.peak_batch = 0  # the largest running batch so far

    # -- any thread ---------------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="gptforge-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, req: Request) -> None:
        """Queue a request's sequences; raises `QueueFull` or `ShuttingDown`."""
        with self._cv:
            if self._draining or self._stop:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) + req.open > self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} sequences waiting); retry later")
            # All of a request's sequences or none: a choice that cannot start must not leave the
            # others generating for a request that failed.
            seqs = [_Seq(req, i * req.n + j, prompt, self) for i, prompt in enumerate(req.prompts)
                    for j in range(req.n)]
            self._waiting.extend(seqs)
            self._gauges()
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        """Stop a request (its client went away); its slots are freed at the next step."""
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    def drain(self) -> None:
        """Refuse new requests from now on; running and queued ones continue."""
        with self._cv:
            self._draining = True

    def idle(self) -> bool:
        with self._cv:
            return not self._waiting and not self._running

    def abort_all(self) -> None:
        """Finish every queued and running sequence now (reason `abort`)."""
        with self._cv:
            for s in list(self._waiting) + self._running:
                s.req.cancelled = True
                self._emit_finish(s, "abort", "")
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        return len(self._running)

    # -- engine thread ------------------------------------------------------------------------

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.batch_size.set(len(self._running))

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._running:
                    self._cv.wait(0.5)
                if self._stop:
                    return
                self._schedule()
            if not self._running:
                continue
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - a failed step ends its sequences, not the server
                msg = f"{type(e).__name__}: {e}"
                with self._cv:
                    for s in list(self._running):
                        self._emit_finish(s, "error", "", error=msg)
                        self._release(s)

    def _schedule(self) -> None:
        """Drop cancelled sequences, admit waiting ones (under the lock)."""
        for s in [s for s in self._running if s.req.cancelled]:
            self._release(s)
        if any(s.req.cancelled for s in self._waiting):
            self._waiting = deque(s for s in self._waiting if not s.req.cancelled)
        while self._waiting and len(self._running) < self.max_batch_size:
            s = self._waiting[0]
            if s.req.cancelled:  # a sibling just failed to start
                self._waiting.popleft()
                continue
            if self._running and self._reserved + s.need > self.max_tokens_in_flight:
                break
            self._waiting.popleft()
            try:
                s.slot = self.slots.new_slot(s.need)
                if s.spec:
                    s.dslot = self.draft_slots.new_slot(s.need)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: this request fails, not the server
                s.slot = s.dslot = None
                self._fail(s, e)
                continue
            self._reserved += s.need
            self._running.append(s)
        self.peak_batch = max(self.peak_batch, len(self._running))
        self._gauges()

    def _fail(self, s: _Seq, e: BaseException) -> None:
        """End `s` with an error event; its request's other choices end with it (the request is
        answered with the error, so nobody would read them). Other requests go on."""
        msg = f"{type(e).__name__}: {e}"
        with self._cv:
            s.req.cancelled = True  # the running siblings leave the batch at the next schedule
            self._emit_finish(s, "error", "", error=msg)
            for o in list(self._waiting) + self._running:
                if o.req is s.req:
                    self._emit_finish(o, "error", "", error=f"choice {s.index} of this request failed: {msg}")

    def _guarded(self, s: _Seq, fn, *args) -> bool:
        """`fn(*args)` (one sequence's share of a step: pick, verify or propose a token); a
        failure ends `s` alone (`_fail`) and counts as finished (True)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - one poisoned sequence must not end the others
            self._fail(s, e)
            return True

    def _forward(self, slots, segs, stepped: list[_Seq]):
        """`slots.step(segs)`, or None when it failed: then every sequence in the step (its KV
        half written) ends with the error; those not in it go on."""
        try:
            return slots.step(segs)
        except Exception as e:  # noqa: BLE001
            for s in stepped:
                self._fail(s, e)
            return None

    def _release(self, s: _Seq) -> None:
        if s in self._running:
            self._running.remove(s)
            self._reserved -= s.need
        s.slot = s.dslot = None  # the slots' buffers go with them

    def _step(self) -> None:
        if self.draft_slots is not None:
            self._spec_step()
            return
        segs, owners, stepped, budget = [], [], [], self.prefill_tokens
        for s in self._running:
            if not s.chunks:
                segs.append(Segment(s.slot, [s.generated[-1]], len(s.prompt) + len(s.generated) - 1, True))
                owners.append(s)
        for s in self._running:
            if s.chunks and s.chunks[0][1] - s.chunks[0][0] <= budget:
                a, b = s.chunks.pop(0)
                budget -= b - a
                segs.append(Segment(s.slot, s.prompt[a:b], a, not s.chunks))
                stepped.append(s)
                if not s.chunks:
                    owners.append(s)
        logits = self._forward(self.slots, segs, owners + stepped)
        if logits is None:
            return
        self.steps += 1
        now = time.perf_counter()
        finished = []
        for s, row in zip(owners, logits, strict=True):
            if self._guarded(s, self._advance, s, row, now):
                finished.append(s)
        if finished:
            with self._cv:
                for s in finished:
                    self._release(s)
                self._gauges()

    def _advance(self, s: _Seq, row: torch.Tensor, now: float) -> bool:
        """Pick, record and stream one token of `s`; True when `s` has finished."""
        p = s.req.params
        if s.done:  # aborted while this step ran
            return True
        hist = torch.tensor([s.prompt + s.generated], dtype=torch.long, device=row.device)
        nxt, logp = choose_next(hist, row[None].clone(), s.processors, s.warpers, p.greedy, s.generator)
        return self._record(s, int(nxt[0]), logp, now)

    def _record(self, s: _Seq, tok: int, logp: torch.Tensor, now: float) -> bool:
        """Record and stream token `tok` of `s` (`logp` [1, V]: the processed distribution it was
        chosen from); True when `s` has finished."""
        p = s.req.params
        s.generated.append(tok)
        m = self.metrics
        if m is not None:
            m.generation_tokens.inc()
            if len(s.generated) == 1:
                m.ttft.observe(now - s.req.arrived)
            else:
                m.itl.observe(now - s.last_time)
        s.last_time = now
        lp = top = None
        if p.logprobs is not None:
            lp = float(logp[0, tok])
            if p.logprobs > 0:
                v, i = torch.topk(logp[0], p.logprobs)
                top = list(zip(i.tolist(), v.tolist(), strict=True))
        if tok in self.eos:
            s.req.sink(TokenEvent(s.index, tok, "", lp, top, eos=True))
            self._emit_finish(s, "stop", self._flush(s))
            return True
        s.text += s.decoder.push(tok)
        stop_at = self._find_stop(s)
        if stop_at is not None:
            s.text = s.text[:stop_at]
            s.req.sink(TokenEvent(s.index, tok, "", lp, top))
            self._emit_finish(s, "stop", self._take(s, len(s.text)))
            return True
        if len(s.generated) >= p.max_tokens:
            s.req.sink(TokenEvent(s.index, tok, "", lp, top))
            self._emit_finish(s, "length", self._flush(s))
            return True
        hold = max((len(x) for x in p.stop), default=1) - 1
        s.req.sink(TokenEvent(s.index, tok, self._take(s, len(s.text) - hold), lp, top))
        return False

    # -- speculative rounds -------------------------------------------------------------------

    def _spec_step(self) -> None:
        """One speculative round for every decoding sequence, with the prompt chunks of
        sequences still being prefilled riding along (the same chunks in draft and target)."""
        decoding = [s for s in self._running if not s.chunks]
        prefill, budget = [], self.prefill_tokens
        for s in self._running:
            if s.chunks and s.chunks[0][1] - s.chunks[0][0] <= budget:
                a, b = s.chunks.pop(0)
                budget -= b - a
                prefill.append((s, a, b, not s.chunks))
        # K of each decoding sequence this round: never past its max_tokens (the last token is
        # the target's own), 0 = a plain step.
        ks = {s: min(s.k, s.req.params.max_tokens - len(s.generated) - 1) if s.spec else 0 for s in decoding}
        drafts = {s: [] for s in decoding if ks[s] > 0}
        qs = {s: [] for s in drafts}
        for i in range(max([ks[s] for s in drafts] + [1 if prefill else 0])):
            segs, owners = [], []
            for s in drafts:
                if i == 0:  # the draft catches up: the last token, and the K-th draft if all were kept
                    seq = s.prompt + s.generated
                    segs.append(Segment(s.dslot, seq[s.dslot.length:], s.dslot.length, True))
                    owners.append(s)
                elif ks[s] > i:
                    segs.append(Segment(s.dslot, [drafts[s][-1]], s.dslot.length, True))
                    owners.append(s)
            if i == 0:
                segs += [Segment(s.dslot, s.prompt[a:b], a, False) for s, a, b, _ in prefill if s.spec]
            if not segs:
                break
            logits = self._forward(self.draft_slots, segs, decoding + [p[0] for p in prefill])
            if logits is None:
                return
            for s, row in zip(owners, logits, strict=True):
                self._guarded(s, self._propose, s, row, drafts[s], qs[s])
            for s in [s for s in drafts if s.done]:  # failed (or a sibling did): out of the round
                del drafts[s], qs[s]
        segs, owners = [], []
        for s in decoding:
            if s.done:
                continue
            last = len(s.prompt) + len(s.generated) - 1
            if s in drafts:
                segs.append(Segment(s.slot, [s.generated[-1]] + drafts[s], last, True, all_logits=True))
            else:
                segs.append(Segment(s.slot, [s.generated[-1]], last, True))
            owners.append(s)
        for s, a, b, final in prefill:
            segs.append(Segment(s.slot, s.prompt[a:b], a, final))
            if final:
                owners.append(s)
        logits = self._forward(self.slots, segs, owners + [p[0] for p in prefill])
        if logits is None:
            return
        self.steps += 1
        now = time.perf_counter()
        finished, o = [], 0
        for s in owners:
            if s in drafts:
                k = len(drafts[s])
                done = self._guarded(s, self._verify, s, logits[o:o + k + 1], drafts[s], qs[s], now)
                o += k + 1
            else:
                done = self._guarded(s, self._advance, s, logits[o], now)
                o += 1
            if done:
                finished.append(s)
        if finished:
            with self._cv:
                for s in finished:
                    self._release(s)
                self._gauges()

    def _scores(self, s: _Seq, hist: list[int], row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(processed scores [1, V], sampling distribution [1, V] or None when greedy) of `row`
        after `hist`: what `choose_next` computes in plain decoding."""
        h = torch.tensor([hist], dtype=torch.long, device=row.device)
        scores = s.processors(h, row[None].clone())
        probs = None if s.req.params.greedy else s.warpers(h, scores.clone()).softmax(-1)
        return scores, probs

    def _propose(self, s: _Seq, row: torch.Tensor, drafts: list[int], qs: list[torch.Tensor]) -> None:
        """The draft's next token from its logits `row` (greedy, or sampled with the sequence's own
        generator from the processed distribution q, kept for the rejection test)."""
        row = align_draft_logits(row, self.slots.backend.vocab_size, self.slots.device)
        scores, q = self._scores(s, s.prompt + s.generated + drafts, row)
        if q is None:
            drafts.append(int(scores.argmax(-1)))
        else:
            drafts.append(int(torch.multinomial(q, 1, generator=s.generator)))
            qs.append(q)

    def _verify(self, s: _Seq, rows: torch.Tensor, drafts: list[int], qs: list[torch.Tensor], now: float) -> bool:
        """Accept a prefix of `drafts` against the target's logits `rows` [k+1, V] (after `last`
        and each draft token), emit the accepted tokens and the target's own, roll both slots back;
        True when `s` has finished."""
        if s.done:  # aborted while this step ran
            return True
        k, base = len(drafts), s.prompt + s.generated
        procs, ps = [], []
        for i in range(k + 1):
            scores, prob = self._scores(s, base + drafts[:i], rows[i])
            procs.append(scores)
            ps.append(prob)
        P = torch.cat(procs)  # [k+1, V]
        d = torch.tensor([drafts], dtype=torch.long, device=P.device)
        if s.req.params.greedy:
            acc, E = accept_greedy(d, P.argmax(-1)[None])
        else:
            acc, E = accept_sampling(d, torch.cat(ps)[None], torch.cat(qs)[None], s.generator)
        acc = int(acc[0])
        self.drafted += k
        self.accepted += acc
        if self.metrics is not None:
            self.metrics.draft_tokens.inc(k)
            self.metrics.draft_accepted_tokens.inc(acc)
        if self.adaptive:
            s.k = next_k(s.k, acc == k)
        logp = torch.log_softmax(P, -1)
        for i, tok in enumerate(E[0, :acc + 1].tolist()):
            if self._record(s, tok, logp[i:i + 1], now):
                return True  # tokens after a stop are dropped
        # Keep what the sequence holds: the target fed `last` and the kept drafts (not the new
        # last token); the draft never saw d_k, so it keeps at most what it fed.
        total = len(s.prompt) + len(s.generated)
        s.slot.truncate(total - 1)
        s.dslot.truncate(min(s.dslot.length, total - 1))
        return False

    def _find_stop(self, s: _Seq) -> int | None:
        stops = s.req.params.stop
        if not stops:
            return None
        longest = max(len(x) for x in stops)
        lo = max(0, s.sent - longest)
        hits = [i for i in (s.text.find(x, lo) for x in stops) if i >= 0]
        return min(hits) if hits else None

    def _take(self, s: _Seq, upto: int) -> str:
        """Text from what was sent up to `upto` (never backwards), marked as sent."""
        upto = max(upto, s.sent)
        piece, s.sent = s.text[s.sent:upto], upto
        return piece

    def _flush(self, s: _Seq) -> str:
        s.text += s.decoder.flush()
        stop_at = self._find_stop(s)
        if stop_at is not None:
            s.text = s.text[:stop_at]
        return self._take(s, len(s.text))

    def _emit_finish(self, s: _Seq, reason: str, text: str, error: str | None = None) -> None:
        if s.done:
            return
        s.done = True
        s.req.open -= 1
        s.req.sink(FinishEvent(s.index, reason, text, len(s.generated), error))
