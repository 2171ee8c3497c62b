"""Offline clients of the engine: many prompts run to completion with continuous batching
(`generate`, `generate_ids`, `infer`, the lm-eval adapter), like vLLM's `LLM.generate`."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from gptforge.generate.backend import PREFILL_CHUNK
from gptforge.generate.engine.core import EngineCore
from gptforge.generate.engine.params import SamplingParams
from gptforge.generate.engine.scheduler import SchedulerConfig
from gptforge.generate.engine.sequence import FinishEvent, Request, Sequence
from gptforge.generate.slots import slots_for

# Offline work has no newcomers to be fair to: bigger prefill steps make bigger, faster GEMMs.
OFFLINE_PREFILL_TOKENS = 32 * PREFILL_CHUNK


def offline_engine(backend, *, eos_token_ids: Seq[int], vocab_limit: int | None, max_batch_size: int,
                   processors=(), tokenizer=None, draft_backend=None, num_draft_tokens="5") -> EngineCore:
    """An `EngineCore` over `backend` (and a draft's) for offline work: failures propagate."""
    draft_slots = slots_for(draft_backend) if draft_backend is not None else None
    core = EngineCore(slots_for(backend), eos_token_ids=eos_token_ids, vocab_limit=vocab_limit,
                      max_positions=backend.max_positions, tokenizer=tokenizer,
                      scheduler=SchedulerConfig(max_batch_size=max(1, max_batch_size), max_queue=1 << 62,
                                                prefill_tokens=OFFLINE_PREFILL_TOKENS),
                      processors=processors, draft_slots=draft_slots, num_draft_tokens=num_draft_tokens,
                      draft_max_positions=draft_backend.max_positions if draft_backend is not None else None)
    core.isolate = False
    return core


def run_requests(core: EngineCore, prompts: Seq[Seq[int]], params: SamplingParams,
                 on_finish=None, keep_scores: bool = True) -> list[Sequence]:
    """Decode every prompt (`params.n` sequences each) to the end; the sequences, prompt-major.
    `on_finish(seq)` is called as each one ends (progress). `keep_scores=False`: no
    `logprob_sum` (greedy steps may then screen the head, `transforms/head_screen.py`)."""
    def sink(ev):
        if on_finish is not None and isinstance(ev, FinishEvent):
            on_finish(ev)

    reqs = [Request([p], params, sink=sink, keep_scores=keep_scores) for p in prompts]
    seqs = [s for r in reqs for s in core.add(r, bounded=False)]
    with torch.inference_mode():
        while core.has_work:
            core.step()
    return seqs
