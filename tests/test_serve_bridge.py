"""The hand-off from the engine thread to the event loop: the events a step produced reach their
queues in order, in one wake-up of the loop per step (`Mailbox`, flushed by the engine's
`on_step` hook), also after `abort_all`; a closed loop drops them without failing the engine."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from gptforge.generate.engine import EngineCore, EngineService, Request, SamplingParams, SchedulerConfig
from gptforge.generate.engine.sequence import FinishEvent, TokenEvent
from gptforge.serve.bridge import Mailbox


def test_a_step_of_events_reaches_the_loop_in_order_with_one_wake_up():
    async def main():
        loop = asyncio.get_running_loop()
        box = Mailbox(loop)
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(1), real(*a))[1]
        queues = [asyncio.Queue(), asyncio.Queue()]

        def engine_step(first):
            for i in range(first, first + 6):
                box.post(queues[i % 2], i)
            box.flush()
            box.flush()  # a second flush before the loop ran: still one wake-up

        t = threading.Thread(target=engine_step, args=(0,))
        t.start()
        t.join()
        assert queues[0].qsize() == queues[1].qsize() == 0  # nothing until the loop runs the delivery
        await asyncio.sleep(0.01)
        assert [queues[0].get_nowait() for _ in range(3)] == [0, 2, 4]
        assert [queues[1].get_nowait() for _ in range(3)] == [1, 3, 5]
        assert wakes == [1]
        box.post(queues[0], 6)  # posted without a flush: stays until the next step's flush
        await asyncio.sleep(0.01)
        assert queues[0].empty()
        threading.Thread(target=box.flush).start()
        assert await asyncio.wait_for(queues[0].get(), 5) == 6 and len(wakes) == 2
        return box

    box = asyncio.run(main())
    box.post(asyncio.Queue(), 7)
    box.flush()  # the loop has closed: dropped, no error on the engine thread
    box.post(asyncio.Queue(), 8)
    box.flush()


class _Slot:
    def __init__(self, capacity):
        self.capacity, self.length = capacity, 0


class _Slots:
    """Fixed logits (a model is not what this tests)."""

    ragged = True
    device = torch.device("cpu")

    def new_slot(self, capacity):
        return _Slot(capacity)

    def step(self, segments):
        for s in segments:
            s.slot.length = s.start + len(s.token_ids)
        n = sum(1 for s in segments if s.want_logits)
        return torch.arange(n * 40, dtype=torch.float32).view(n, 40) % 37


def test_the_engine_calls_its_step_hooks_after_every_step_and_after_abort_all():
    core = EngineCore(_Slots(), eos_token_ids=[], vocab_limit=None, max_positions=64,
                      scheduler=SchedulerConfig(max_batch_size=4))
    service = EngineService(core)
    events, seen = [], []
    service.on_step(lambda: seen.append(len(events)))
    service.start()
    try:
        req = Request([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0), sink=events.append)
        service.submit(req)
        deadline = time.monotonic() + 30
        while not any(isinstance(e, FinishEvent) for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert [type(e) for e in events] == [TokenEvent] * 5 + [FinishEvent]
        assert seen[:5] == [1, 2, 3, 4, 6]  # a hook call after each step's events (the last step: token + finish)
    finally:
        service.stop()
    idle = EngineService(EngineCore(_Slots(), eos_token_ids=[], vocab_limit=None, max_positions=64))
    aborted, calls = [], []
    idle.on_step(lambda: calls.append(len(aborted)))
    idle.core.add(Request([[4, 5]], SamplingParams(max_tokens=9), sink=aborted.append))
    idle.abort_all()
    assert calls == [1] and aborted[0].reason == "abort"
