"""The async bridge between HTTP handlers and the engine (`generate.engine.EngineService`): a
submitted request's events, fed by the engine thread into an asyncio queue. No decoding here."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from gptforge.generate.engine import QueueFull, Request, SamplingParams, ShuttingDown, TokenEvent
from gptforge.serve.protocol import APIError


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0


class Mailbox:
    """Engine events on their way to one event loop. Sinks `post` them on the engine thread; the
    engine's `on_step` hook `flush`es them after each step in one `call_soon_threadsafe`. One
    wake-up of the loop per event would make the engine thread wait for the loop to yield the
    GIL once per event (measured: 0.4-0.8 ms of engine wall time per streamed token at 16-64
    clients), and the loop would wake once per event instead of once per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []
        self._scheduled = False

    def post(self, queue: asyncio.Queue, ev) -> None:  # engine thread
        with self._lock:
            self._items.append((queue, ev))

    def flush(self) -> None:  # engine thread, after each step
        with self._lock:
            if not self._items or self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop has closed (the server stopped): nobody is listening
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _deliver(self) -> None:  # event loop
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, ev in items:
            queue.put_nowait(ev)


def mailbox(state) -> Mailbox:
    """The running loop's mailbox for `state.engine` (made and hooked to the engine once per loop)."""
    loop = asyncio.get_running_loop()
    box = state.mailbox
    if box is None or box.loop is not loop:
        box = state.mailbox = Mailbox(loop)
        state.engine.on_step(box.flush)
    return box


class RequestTimeout(Exception):
    """The request ran past `--request-timeout` (it has been cancelled)."""


class Run:
    """One submitted request: an asyncio queue fed by the engine thread."""

    def __init__(self, state, prompts: list[list[int]], params: SamplingParams, n: int):
        self.state = state
        self.mailbox = mailbox(state)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.req = Request(prompts, params, n, self._sink, keep_scores=False)  # no response carries them
        self.choices = [Choice() for _ in range(len(prompts) * n)]
        self.open = len(self.choices)
        self.error: str | None = None
        self._closed = False
        self.deadline = None if state.request_timeout is None else time.monotonic() + state.request_timeout
        try:
            state.engine.submit(self.req)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_exceeded", code="queue_full") from None
        except ShuttingDown as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None
        state.inflight += 1
        state.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        state.metrics.model_requests.labels(params.adapter or state.model_name).inc()

    def _sink(self, ev) -> None:  # engine thread
        self.mailbox.post(self.queue, ev)

    async def events(self):
        """Engine events until every choice has finished (each event also updates `choices`);
        `RequestTimeout` (the request cancelled) past the deadline."""
        while self.open:
            try:
                left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
                ev = await asyncio.wait_for(self.queue.get(), left)
            except TimeoutError:
                self.close()
                raise RequestTimeout from None
            if ev is None:  # the client left
                return
            c = self.choices[ev.index]
            if isinstance(ev, TokenEvent):
                if not ev.eos:
                    c.tokens.append(ev.token_id)
                    if ev.logprob is not None:
                        c.logprobs.append(ev.logprob)
                        c.top.append(ev.top or [])
                c.text.append(ev.text)
            else:
                c.text.append(ev.text)
                c.finish_reason = ev.reason
                c.completion_tokens = ev.completion_tokens
                self.error = self.error or ev.error
                self.open -= 1
            yield ev

    def close(self) -> None:
        """Cancel what is still running (the client left) and count the request as done."""
        if self.open:
            self.state.engine.cancel(self.req)
            self.open = 0
        if not self._closed:
            self._closed = True
            self.state.inflight -= 1

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.req.prompts)
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def watch_disconnect(request, run: Run) -> None:
    """Cancel `run` when the client goes away."""
    while run.open:
        if await request.is_disconnected():
            run.close()
            run.queue.put_nowait(None)
            return
        await asyncio.sleep(0.1)
