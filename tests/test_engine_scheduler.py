"""The engine's scheduler is bookkeeping only, so it is tested without a model: admission by
batch size and KV positions in flight, the bounded queue, cancellation, prompt chunks at the
fixed 32-token cuts, and fairness to newcomers (the prefill budget goes to the oldest prompts,
several chunks of one prompt per step, every step carries prefill work while there is any)."""

from __future__ import annotations

import pytest

from gptforge.generate.engine import QueueFull, Request, SamplingParams, Scheduler, SchedulerConfig
from gptforge.generate.engine.sequence import Sequence


def _seqs(lengths, max_tokens=8):
    out = []
    for n in lengths:
        req = Request([list(range(1, n + 1))], SamplingParams(max_tokens=max_tokens))
        out.append(Sequence(req, 0, req.prompts[0]))
    return out


def _admit_all(sch):
    return sch.admit(lambda s: True)


def test_admission_by_batch_size_and_tokens_in_flight_and_the_queue_bound():
    sch = Scheduler(SchedulerConfig(max_batch_size=3, max_tokens_in_flight=100, max_queue=5), max_positions=64)
    a = _seqs([40, 40, 10, 10, 10])  # need 48, 48, 18, 18, 18
    sch.add(a)
    with pytest.raises(QueueFull):
        sch.add(_seqs([1]))
    assert _admit_all(sch) == a[:2]  # a third would pass 100 reserved positions
    sch.release(a[0])
    assert _admit_all(sch) == a[2:4]  # 48 + 18 + 18 <= 100; the batch is full at 3
    assert sch.reserved == 48 + 18 + 18 and len(sch.waiting) == 1
    a[4].req.cancelled = True
    a[2].req.cancelled = True
    assert sch.drop_cancelled() == [a[2]] and not sch.waiting and len(sch.running) == 2


def test_a_lone_sequence_is_admitted_even_past_the_token_bound():
    sch = Scheduler(SchedulerConfig(max_batch_size=4, max_tokens_in_flight=10), max_positions=64)
    big = _seqs([60])
    sch.add(big)
    assert _admit_all(sch) == big  # never stuck: the bound is at least one context


def test_prefill_budget_goes_to_the_oldest_prompts_in_fixed_chunks():
    sch = Scheduler(SchedulerConfig(max_batch_size=8, prefill_tokens=96), max_positions=256)
    old, mid, new = _seqs([70, 40, 20])
    sch.add([old, mid, new])
    _admit_all(sch)
    plan = sch.plan()
    # the oldest prompt takes all its chunks (0-32, 32-64, 64-70); the next one's first chunk
    # (32 tokens) does not fit the 26 left, and a younger prompt does not jump the queue
    assert [(s, a, b) for s, a, b in plan.prefill] == [(old, 0, 32), (old, 32, 64), (old, 64, 70)]
    assert mid.chunks == [(0, 32), (32, 40)] and new.chunks == [(0, 20)]
    old.generated.append(5)  # its first token came out of this step
    plan = sch.plan()
    assert plan.decode == [old] and [(s, a, b) for s, a, b in plan.prefill] == [(mid, 0, 32), (mid, 32, 40),
                                                                                (new, 0, 20)]


def test_a_newcomer_waits_only_for_the_prompts_ahead_of_it():
    """64 prompts arrive together: with a 512-token budget the last one is prefilled within
    ceil(all prompt tokens / 512) steps, whatever the decodes do."""
    lengths = [16 + (i * 37) % 64 for i in range(64)]
    sch = Scheduler(SchedulerConfig(max_batch_size=64, prefill_tokens=512), max_positions=256)
    seqs = _seqs(lengths, max_tokens=64)
    sch.add(seqs)
    _admit_all(sch)
    steps = 0
    while any(s.chunks for s in seqs):
        plan = sch.plan()
        assert plan.prefill  # every step carries prefill work while there is any
        for s in plan.decode:
            s.generated.append(1)
        for s, _, b in plan.prefill:
            if b == len(s.prompt):
                s.generated.append(1)
        steps += 1
    assert steps <= -(-sum(lengths) // 512) + 1, steps


def _step(sch, plan):
    """What the engine does with a plan, minus the model: decodes and finished prompts get a token."""
    for s in plan.decode:
        s.generated.append(1)
    for s, _, b in plan.prefill:
        if b == len(s.prompt):
            s.generated.append(1)


def test_a_newcomer_gets_its_first_token_beside_64_long_running_decodes():
    """Fairness both ways: with 64 sequences decoding for a long time, each of a stream of new
    arrivals (one per step, 40..110-token prompts) has its first token within 3 steps of its
    arrival, and every running sequence decodes at every step (no starvation either way)."""
    sch = Scheduler(SchedulerConfig(max_batch_size=128, prefill_tokens=128), max_positions=1024)
    old = _seqs([20] * 64, max_tokens=900)
    sch.add(old)
    _admit_all(sch)
    while any(s.chunks for s in old):
        _step(sch, sch.plan())
    before = [len(s.generated) for s in old]
    arrivals = {}
    for t in range(40):
        new = _seqs([40 + (t * 29) % 71], max_tokens=8)[0]
        sch.add([new])
        arrivals[new] = t
        _admit_all(sch)
        plan = sch.plan()
        decoding = [s for s in sch.running if not s.chunks and s.generated]
        assert set(decoding) <= set(plan.decode)  # nobody past its prompt waits
        _step(sch, plan)
        for s in [s for s in arrivals if s.generated]:
            assert t - arrivals.pop(s) < 3, "a newcomer waited more than 3 steps for its first token"
        for s in [s for s in sch.running if s.generated and len(s.generated) >= s.params.max_tokens]:
            sch.release(s)
    assert len(arrivals) <= 2 and [len(s.generated) - n for s, n in zip(old, before, strict=True)] == [40] * 64
