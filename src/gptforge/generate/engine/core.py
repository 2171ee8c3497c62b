"""`EngineCore`: one step of continuous batching = schedule → (propose) → run → sample / verify →
output. Synchronous and single-threaded: offline clients (`generate`, `stream`, the lm-eval
adapter) call `run()` until their requests finish; `EngineService` runs it on a thread for
`serve`.

Per-request isolation (with `isolate`, the default; offline clients turn it off and see the
exception): a failure while admitting, sampling, verifying or recording one sequence ends that
sequence and the other choices of its request (`FinishEvent` with reason `error`); the step's
other rows go on. A failure of the model step itself ends the sequences that were in it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import torch

from gptforge.generate.engine.output import OutputProcessor
from gptforge.generate.engine.runner import Work, run_step, stack_rows
from gptforge.generate.engine.sampler import Sampler
from gptforge.generate.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from gptforge.generate.engine.sequence import Request, Sequence
from gptforge.generate.engine.spec import SpecStats, Speculator
from gptforge.generate.processors import LogitsProcessor, argmax_mask


class EngineCore:
    """Continuous batching over `slots` (`generate.slots.slots_for(backend)`), optionally with a
    draft's `draft_slots` for speculative decoding."""

    def __init__(self, slots, *, eos_token_ids: Seq[int], vocab_limit: int | None, max_positions: int,
                 tokenizer=None, scheduler: SchedulerConfig | None = None, metrics=None,
                 processors: Seq[LogitsProcessor] = (), draft_slots=None, num_draft_tokens="5",
                 draft_max_positions: int | None = None):
        self.slots = slots
        self.max_positions = max_positions
        self.metrics = metrics
        self.scheduler = Scheduler(scheduler or SchedulerConfig(), max_positions)
        self.sampler = Sampler(eos_token_ids, vocab_limit, slots.device, processors)
        self.output = OutputProcessor(tokenizer, eos_token_ids, metrics)
        self.spec: Speculator | None = None
        if draft_slots is not None:
            if not (getattr(slots, "ragged", False) or hasattr(slots.backend, "step_all")):
                raise ValueError("speculative decoding needs target slots that return the logits of every position")
            self.spec = Speculator(draft_slots, num_draft_tokens, self.sampler, slots.backend.vocab_size,
                                   slots.device, draft_max_positions or max_positions, metrics,
                                   guard=lambda compute, items: self._isolated(compute, items),
                                   on_error=lambda: self._on_error())
        self.steps = 0
        self.isolate = True  # False (offline clients): a failure propagates to the caller

    # -- requests -------------------------------------------------------------------------------

    def add(self, req: Request, bounded: bool = True) -> list[Sequence]:
        """Queue a request's sequences (`QueueFull` past the bound when `bounded`)."""
        seqs = [Sequence(req, i * req.n + j, prompt) for i, prompt in enumerate(req.prompts) for j in range(req.n)]
        self.scheduler.add(seqs, bounded)
        return seqs

    @property
    def stats(self) -> SpecStats | None:
        return self.spec.stats if self.spec is not None else None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- one step -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Drop cancelled sequences, admit waiting ones, plan the step (cheap; no model work)."""
        sch = self.scheduler
        sch.drop_cancelled()
        sch.admit(self._admit)
        return sch.plan()

    def _admit(self, s: Sequence) -> bool:
        """Give `s` its slots and sampling state; False (and `s` ended) if that fails (e.g. out
        of memory): its request fails, not the engine."""
        try:
            s.slot = self.slots.new_slot(s.need)
            self.sampler.setup(s)
            self.output.start(s)
            if self.spec is not None:
                self.spec.admit(s)
            return True
        except Exception as e:  # noqa: BLE001
            if not self.isolate:
                raise
            s.slot = s.dslot = None
            self._fail(s, e)
            return False

    def step(self, plan: StepPlan | None = None) -> None:
        """Run one model step (of `plan`, else a fresh one) and emit its tokens."""
        plan = self.schedule() if plan is None else plan
        if not plan:
            return
        in_step = plan.decode + [s for s, _, _ in plan.prefill]
        try:
            props = self.spec.propose(plan.decode, plan.prefill) if self.spec is not None else {}
            works = [self._decode_work(s, props.get(s)) for s in plan.decode if not s.done]
            works += [Work(s, s.prompt[a:b], a, last, argmax_masks=self._argmax_masks(s, 1) if last else None)
                      for s, a, b in plan.prefill for last in [not s.chunks and b == len(s.prompt)]]
            outs = run_step(self.slots, works)
        except Exception as e:  # noqa: BLE001 - a failed step ends its sequences, not the engine
            if not self.isolate:
                raise
            for s in dict.fromkeys(in_step):  # their KV slots are half written: they end, the others go on
                self._fail(s, e)
            self._release_done()
            return
        self.steps += 1
        now = time.perf_counter()
        plain = [(w.seq, o) for w, o in zip(works, outs, strict=True) if o is not None and w.seq not in props]
        spec = [(w.seq, o, props[w.seq]) for w, o in zip(works, outs, strict=True) if w.seq in props]
        self._emit(plain, now, verify=False)
        self._emit(spec, now, verify=True)
        self._release_done()

    def _release_done(self) -> None:
        for s in [s for s in self.scheduler.running if s.done]:
            self.scheduler.release(s)
            if not s.req.open:
                self.sampler.forget(s.params)

    def _decode_work(self, s: Sequence, prop) -> Work:
        last = len(s.prompt) + len(s.generated) - 1
        if prop is None:
            return Work(s, [s.generated[-1]], last, True, argmax_masks=self._argmax_masks(s, 1))
        n = 1 + len(prop.tokens)
        return Work(s, [s.generated[-1]] + prop.tokens, last, True, all_logits=True,
                    argmax_masks=self._argmax_masks(s, n))

    @staticmethod
    def _argmax_masks(s: Sequence, n: int) -> list | None:
        """The columns left to `s`'s next `n` tokens (a verification's rows: after each draft token)
        when only their greedy choices are read (no sampling, no log-probs or kept scores, only
        column-forbidding processors), else None."""
        if s.sampling is None or s.sampling.warpers is not None or s.req.keep_scores or s.params.logprobs is not None:
            return None
        at = len(s.prompt) + len(s.generated)
        masks = [argmax_mask(s.sampling.processors, at + i) for i in range(n)]
        return None if None in masks else masks

    def _isolated(self, compute, items: list) -> list:
        """`compute(items)` (one result per item, None for an item it ended); if it fails, again
        one item at a time: an item that fails alone ends its sequence with an error and gets
        None. (Random draws are made per row inside `compute` and never repeated: a failing draw
        ends its row there.)"""
        try:
            return compute(items)
        except Exception:  # noqa: BLE001 - find the sequence(s) at fault below
            if not self.isolate:
                raise
        out = []
        for item in items:
            try:
                out.append(compute([item])[0])
            except Exception as e:  # noqa: BLE001 - one sequence's failure is its own
                self._fail(item[0], e)
                out.append(None)
        return out

    def _fail(self, s: Sequence, e: BaseException) -> None:
        """End `s` with an error event; its request's other choices end with it (the request is
        answered with the error, so nobody would read them). Other requests go on."""
        msg = f"{type(e).__name__}: {e}"
        s.req.cancelled = True  # waiting siblings are dropped, running ones leave at the next step
        self.output.finish(s, "error", "", msg)
        sch = self.scheduler
        for o in list(sch.waiting) + list(sch.running):
            if o.req is s.req:
                self.output.finish(o, "error", "", f"choice {s.index} of this request failed: {msg}")

    def _on_error(self):
        return self._fail if self.isolate else None

    def _choose(self, items: list) -> list:
        """([token], [its log-probs [V], or None when nobody reads them]) per (sequence, logits),
        None where the draw failed."""
        rows = [(s, ()) for s, _ in items]
        scored = self.sampler.score(rows, stack_rows([o for _, o in items]))
        toks = self.sampler.choose(rows, scored, self._on_error())
        # A log-softmax over the vocabulary per row costs about what the sampler does: only for
        # requests that keep scores (offline clients) or asked for log-probs.
        want = [r for r, (s, _) in enumerate(rows) if s.req.keep_scores or s.params.logprobs is not None]
        logp = dict(zip(want, scored.logprobs(want), strict=True)) if want else {}
        return [None if tok is None else ([tok], [logp.get(r)]) for r, tok in enumerate(toks)]

    def _emit(self, items: list, now: float, verify: bool) -> None:
        """Choose (or verify) the tokens of `items`, then record them sequence by sequence."""
        items = [x for x in items if not x[0].done]
        if not items:
            return
        results = self._isolated(self.spec.verify if verify else self._choose, items)
        for item, res in zip(items, results, strict=True):
            s = item[0]
            if res is None or s.done:
                continue
            try:
                for tok, lp in zip(res[0], res[1], strict=False):
                    if self.output.record(s, tok, lp, now):
                        break  # tokens after a stop are dropped
                if verify and not s.done:
                    self.spec.rollback(s)
            except Exception as e:  # noqa: BLE001 - one sequence's failure is its own
                if not self.isolate:
                    raise
                self._fail(s, e)

    # -- offline --------------------------------------------------------------------------------

    def run(self, requests: Seq[Request] = ()) -> None:
        """Add `requests` (unbounded) and step until nothing is left."""
        for r in requests:
            self.add(r, bounded=False)
        with torch.inference_mode():
            while self.has_work:
                self.step()
