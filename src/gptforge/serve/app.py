"""The HTTP layer of `gptforge serve`: a FastAPI app with OpenAI's completions and chat
endpoints (JSON or server-sent events), `/v1/models`, `/health` and `/metrics`.

Handlers turn a request into token-id prompts and `SamplingParams`, hand them to the `Engine`
and translate its events into OpenAI responses. A client that goes away cancels its request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from gptforge.serve.chat import ChatTemplate
from gptforge.serve.engine import Engine, FinishEvent, QueueFull, SamplingParams, ShuttingDown, TokenEvent
from gptforge.serve.engine import Request as EngineRequest
from gptforge.serve.gate import Gate
from gptforge.serve.metrics import CONTENT_TYPE, ServeMetrics
from gptforge.serve.protocol import APIError, ChatRequest, CompletionRequest


@dataclass
class ServeState:
    """What the handlers share."""

    engine: Engine
    tokenizer: object
    model_name: str
    max_positions: int
    vocab_size: int
    metrics: ServeMetrics
    chat: ChatTemplate
    api_key: str | None = None
    public_metrics: bool = False  # /metrics without the API key
    max_body_bytes: int = 8 << 20
    request_timeout: float | None = None  # seconds from arrival; None = no limit
    max_prompt_chars: int | None = None  # longer text cannot fit the context (None: no cheap bound)
    close: object = None  # releases the backend (the packed weights) when the server stops
    draining: bool = False
    inflight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0


class RequestTimeout(Exception):
    """The request ran past `--request-timeout` (it has been cancelled)."""


class _Run:
    """One submitted request: an asyncio queue fed by the engine thread."""

    def __init__(self, state: ServeState, prompts: list[list[int]], params: SamplingParams, n: int):
        self.state = state
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.req = EngineRequest(prompts, params, n, self._sink)
        self.choices = [_Choice() for _ in range(len(prompts) * n)]
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


async def _watch_disconnect(request: Request, run: _Run) -> None:
    while run.open:
        if await request.is_disconnected():
            run.close()
            run.queue.put_nowait(None)
            return
        await asyncio.sleep(0.1)


def _tok_str(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid])


def _completion_logprobs(tokenizer, c: _Choice, offset: int) -> dict:
    strs = [_tok_str(tokenizer, t) for t in c.tokens[: len(c.logprobs)]]
    offsets, pos = [], offset
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": strs, "token_logprobs": c.logprobs,
            "top_logprobs": [{_tok_str(tokenizer, t): lp for t, lp in top} for top in c.top],
            "text_offset": offsets}


def _chat_logprobs(tokenizer, tokens: list[int], logprobs: list[float], tops: list) -> dict:
    def entry(t, lp):
        s = _tok_str(tokenizer, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                        for t, lp, top in zip(tokens, logprobs, tops, strict=False)]}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _timeout_error(state: ServeState) -> APIError:
    return APIError(504, f"the request ran longer than this server's limit of {state.request_timeout:g} s "
                    "(gptforge serve --request-timeout) and was cancelled", type="server_error", code="timeout")


async def _stream_events(run: _Run):
    """`run.events()` for a server-sent stream: a timeout ends it with an error event."""
    try:
        async for ev in run.events():
            yield ev
    except RequestTimeout:
        yield _timeout_error(run.state)


def prompt_char_limit(tokenizer, max_positions: int) -> int | None:
    """Characters beyond which a text cannot fit `max_positions` tokens, whatever it says:
    positions x the longest token of a byte-level vocabulary (every byte of the text is in some
    token, and a character is at least one byte). None for other tokenizers, where a token may
    stand for more text than it spells (an unknown-token symbol, dropped characters, a
    normalizer): then the body limit alone bounds a prompt."""
    backend = getattr(tokenizer, "backend", None)
    try:
        if "ByteLevel" not in repr(backend.pre_tokenizer) or backend.normalizer is not None:
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
    except AttributeError:
        return None
    return max_positions * max(len(t) for t in vocab) if vocab else None


def _openai_errors(app: FastAPI) -> None:
    """Every error the app answers in OpenAI's shape: ours, pydantic's 400s, Starlette's 404 / 405."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        if err.get("type") == "json_invalid":  # loc holds the character position, not a field
            pos = err.get("loc", ("body", "?"))[-1]
            why = (err.get("ctx") or {}).get("error", "JSON decode error")
            return JSONResponse(APIError(400, f"the request body is not valid JSON: {why} (at character {pos})",
                                         code="invalid_json").body(), status_code=400)
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        return JSONResponse(APIError(400, f"{param}: {msg}" if param else msg, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        msg = f"Invalid URL ({request.method} {request.url.path})" if e.status_code == 404 else str(e.detail)
        return JSONResponse(APIError(e.status_code, msg).body(), status_code=e.status_code, headers=e.headers)


def create_app(state: ServeState) -> FastAPI:
    """The FastAPI application over a started `Engine`."""
    app = FastAPI(title="gptforge serve", docs_url=None, redoc_url=None)
    app.state.serve = state
    tok = state.tokenizer
    _openai_errors(app)
    app.add_middleware(Gate, state=state, api=app)

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return {"status": "ok", "model": state.model_name}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "gptforge"}]}

    def check_model(name: str) -> None:
        if name != state.model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{state.model_name}`)",
                           param="model", code="model_not_found")

    def check_prompt(ids: list[int], max_tokens: int, i: int) -> None:
        if not ids:
            raise APIError(400, f"prompt {i}: empty prompt", param="prompt")
        bad = [t for t in ids if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(400, f"prompt {i}: token id {bad[0]} is outside the vocabulary of {state.vocab_size}",
                           param="prompt")
        if len(ids) + max_tokens > state.max_positions:
            raise APIError(400, f"This model's maximum context length is {state.max_positions} tokens. However, you "
                           f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for "
                           "the completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens" if len(ids) < state.max_positions else "prompt",
                           code="context_length_exceeded")

    def check_chars(text: str, what: str) -> None:
        """Refuse, before tokenizing it, text too long for the context whatever its tokens."""
        limit = state.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(400, f"{what}: {len(text)} characters cannot fit this model's maximum context length of "
                           f"{state.max_positions} tokens (no text over {limit} characters can); shorten it",
                           param=what.split(" ")[0], code="context_length_exceeded")

    def params_of(body, max_tokens: int, stop: list[str], logprobs: int | None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=max(body.top_k, 0), repetition_penalty=body.repetition_penalty,
                              seed=body.seed, stop=stop, logprobs=logprobs)

    async def collect(request: Request, run: _Run) -> None:
        watch = asyncio.create_task(_watch_disconnect(request, run))
        try:
            async for _ in run.events():
                pass
        except RequestTimeout:
            raise _timeout_error(state) from None
        finally:
            watch.cancel()
            run.close()
        if run.error:
            raise APIError(500, f"generation failed: {run.error}", type="server_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        p = body.prompt
        if isinstance(p, str):
            texts = [p]
        elif p and all(isinstance(x, str) for x in p):
            texts = list(p)
        else:
            texts = None
        if texts is not None:
            for i, t in enumerate(texts):
                check_chars(t, f"prompt {i}")
            # Off the event loop: other requests' streams and /health go on while this encodes.
            # (One by one: encode_batch's thread pool would warn in every process forked later.)
            prompts = await run_in_threadpool(lambda: [tok.encode(t) for t in texts])
        else:
            prompts = [list(p)] if p and isinstance(p[0], int) else [list(x) for x in p]
        if not prompts:
            raise APIError(400, "prompt: empty list", param="prompt")
        max_tokens = body.max_tokens or 16
        for i, ids in enumerate(prompts):
            check_prompt(ids, max_tokens, i)
        if texts is None:  # token-id prompts: their text only for echo, once they are known to fit
            texts = [tok.decode(x) for x in prompts] if body.echo else [""] * len(prompts)
        run = _Run(state, prompts, params_of(body, max_tokens, body.stops(), body.logprobs), body.n)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
        n = body.n

        def prefix(i: int) -> str:
            return texts[i // n] if body.echo else ""

        if body.stream:
            async def sse():
                try:
                    if body.echo:
                        for i in range(len(run.choices)):
                            yield _sse({**head, "choices": [{"index": i, "text": prefix(i), "logprobs": None,
                                                             "finish_reason": None}]})
                    async for ev in _stream_events(run):
                        if isinstance(ev, APIError):
                            yield _sse(ev.body())
                            continue
                        if isinstance(ev, TokenEvent) and (ev.eos or (not ev.text and ev.logprob is None)):
                            continue
                        lp = None
                        if isinstance(ev, TokenEvent) and ev.logprob is not None:
                            one = _Choice(tokens=[ev.token_id], logprobs=[ev.logprob], top=[ev.top or []])
                            lp = _completion_logprobs(tok, one, 0)
                        fin = ev.reason if isinstance(ev, FinishEvent) else None
                        if isinstance(ev, FinishEvent) and ev.error:
                            yield _sse({"error": {"message": f"generation failed: {ev.error}", "type": "server_error"}})
                        yield _sse({**head, "choices": [{"index": ev.index, "text": ev.text, "logprobs": lp,
                                                         "finish_reason": fin}]})
                    if body.stream_options and body.stream_options.include_usage:
                        yield _sse({**head, "choices": [], "usage": run.usage()})
                    yield "data: [DONE]\n\n"
                finally:
                    run.close()

            return StreamingResponse(sse(), media_type="text/event-stream")

        await collect(request, run)
        choices = []
        for i, c in enumerate(run.choices):
            text = prefix(i) + "".join(c.text)
            lp = _completion_logprobs(tok, c, len(prefix(i))) if body.logprobs is not None else None
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {**head, "choices": choices, "usage": run.usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model(body.model)
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        check_chars("".join(m["content"] for m in msgs), "messages")
        try:
            text = await run_in_threadpool(state.chat.render, msgs)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        check_chars(text, "messages")
        ids = await run_in_threadpool(tok.encode, text)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, state.max_positions - len(ids))
        check_prompt(ids, max_tokens, 0)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        run = _Run(state, [ids], params_of(body, max_tokens, body.stops() + state.chat.stop, logprobs), body.n)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name}

        if body.stream:
            chead = {**head, "object": "chat.completion.chunk"}

            async def sse():
                try:
                    for i in range(len(run.choices)):
                        yield _sse({**chead, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}]})
                    async for ev in _stream_events(run):
                        if isinstance(ev, APIError):
                            yield _sse(ev.body())
                        elif isinstance(ev, TokenEvent):
                            if ev.eos or (not ev.text and ev.logprob is None):
                                continue
                            lp = (_chat_logprobs(tok, [ev.token_id], [ev.logprob], [ev.top or []])
                                  if ev.logprob is not None else None)
                            yield _sse({**chead, "choices": [{"index": ev.index, "delta": {"content": ev.text},
                                                              "logprobs": lp, "finish_reason": None}]})
                        else:
                            if ev.error:
                                yield _sse({"error": {"message": f"generation failed: {ev.error}",
                                                      "type": "server_error"}})
                            delta = {"content": ev.text} if ev.text else {}
                            yield _sse({**chead, "choices": [{"index": ev.index, "delta": delta, "logprobs": None,
                                                              "finish_reason": ev.reason}]})
                    if body.stream_options and body.stream_options.include_usage:
                        yield _sse({**chead, "choices": [], "usage": run.usage()})
                    yield "data: [DONE]\n\n"
                finally:
                    run.close()

            return StreamingResponse(sse(), media_type="text/event-stream")

        await collect(request, run)
        choices = []
        for i, c in enumerate(run.choices):
            lp = _chat_logprobs(tok, c.tokens, c.logprobs, c.top) if body.logprobs else None
            choices.append({"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                            "logprobs": lp, "finish_reason": c.finish_reason})
        return {**head, "choices": choices, "usage": run.usage()}

    return app
