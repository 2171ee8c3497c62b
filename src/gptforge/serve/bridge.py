"""The async bridge between HTTP handlers and the engine (`generate.engine.EngineService`): a
submitted request's events, fed by the engine thread into an asyncio queue. No decoding here."""

from __future__ import annotations

import asyncio
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


class RequestTimeout(Exception):
    """The request ran past `--request-timeout` (it has been cancelled)."""


class Run:
    """One submitted request: an asyncio queue fed by the engine thread."""

    def __init__(self, state, prompts: list[list[int]], params: SamplingParams, n: int):
        self.state = state
        self.loop = asyncio.get_running_loop()
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
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)

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
