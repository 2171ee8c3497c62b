"""The HTTP layer of `gptforge serve`: a FastAPI app with OpenAI's completions and chat
endpoints (JSON or server-sent events), `/v1/models`, `/health` and `/metrics`.

Handlers (module-level functions; the app's `state.serve` is their `ServeState`) turn a request
into token-id prompts and `SamplingParams`, hand them to the engine (`generate.engine`, through
`bridge.Run`) and translate its events into OpenAI responses; one SSE helper streams both
endpoints. A client that goes away cancels its request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from gptforge.data.chat_template import ChatTemplate
from gptforge.errors import DataError
from gptforge.generate.engine import EngineService, FinishEvent, SamplingParams, TokenEvent
from gptforge.serve.bridge import Choice, RequestTimeout, Run, watch_disconnect
from gptforge.serve.gate import Gate
from gptforge.serve.metrics import CONTENT_TYPE, ServeMetrics
from gptforge.serve.protocol import APIError, ChatRequest, CompletionRequest


@dataclass
class ServeState:
    """What the handlers share."""

    engine: EngineService
    tokenizer: object
    model_name: str  # the base model's served name
    max_positions: int
    vocab_size: int
    metrics: ServeMetrics
    chat: ChatTemplate  # the model's own (data/chat_template.py), or --chat-template's
    api_key: str | None = None
    public_metrics: bool = False  # /metrics without the API key
    max_body_bytes: int = 8 << 20
    request_timeout: float | None = None  # seconds from arrival; None = no limit
    max_prompt_chars: int | None = None  # longer text cannot fit the context (None: no cheap bound)
    sampling_defaults: dict = field(default_factory=dict)  # for fields a request omits (ServeOptions)
    adapters: list[str] = field(default_factory=list)  # LoRA adapters served by name over the base
    close: object = None  # releases the backend (the packed weights) when the server stops
    mailbox: object = None  # bridge.Mailbox: the engine's events to the event loop, a step at a time
    draining: bool = False
    inflight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


def _tok_str(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid])


def _completion_logprobs(tokenizer, c: Choice, offset: int) -> dict:
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


def _stream(run: Run, head: dict, opening: list[dict], render: Callable[[object], dict],
            include_usage: bool) -> StreamingResponse:
    """The server-sent events of a request (completions and chat alike): the `opening` choice
    chunks, one chunk per event with text or log-probs (`render(event)` makes its choice), an
    error event before a failed choice's last chunk, the usage if asked, then [DONE]. A timeout
    ends the stream with an error event."""
    async def events():
        try:
            for choice in opening:
                yield _sse({**head, "choices": [choice]})
            try:
                async for ev in run.events():
                    if isinstance(ev, TokenEvent) and (ev.eos or (not ev.text and ev.logprob is None)):
                        continue
                    if isinstance(ev, FinishEvent) and ev.error:
                        yield _sse({"error": {"message": f"generation failed: {ev.error}", "type": "server_error"}})
                    yield _sse({**head, "choices": [render(ev)]})
            except RequestTimeout:
                yield _sse(_timeout_error(run.state).body())
            if include_usage:
                yield _sse({**head, "choices": [], "usage": run.usage()})
            yield "data: [DONE]\n\n"
        finally:
            run.close()

    return StreamingResponse(events(), media_type="text/event-stream")


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


def _state(request: Request) -> ServeState:
    return request.app.state.serve


async def health(request: Request):
    state = _state(request)
    if state.draining:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    return {"status": "ok", "model": state.model_name}


async def metrics(request: Request):
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def models(request: Request):
    """The base and each adapter (`parent`: the base, as vLLM lists LoRA modules)."""
    state = _state(request)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                        "owned_by": "gptforge", "parent": parent}
                                       for name, parent in [(state.model_name, None)]
                                       + [(a, state.model_name) for a in state.adapters]]}


def _check_model(state: ServeState, name: str) -> str | None:
    """The adapter a request's `model` picks (None: the base); 404 naming the served models."""
    if name == state.model_name:
        return None
    if name in state.adapters:
        return name
    served = ", ".join(f"`{m}`" for m in [state.model_name, *state.adapters])
    raise APIError(404, f"The model `{name}` does not exist (this server serves {served})",
                   param="model", code="model_not_found")


def _check_prompt(state: ServeState, ids: list[int], max_tokens: int, i: int) -> None:
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


def _check_chars(state: ServeState, text: str, what: str) -> None:
    """Refuse, before tokenizing it, text too long for the context whatever its tokens."""
    limit = state.max_prompt_chars
    if limit is not None and len(text) > limit:
        raise APIError(400, f"{what}: {len(text)} characters cannot fit this model's maximum context length of "
                       f"{state.max_positions} tokens (no text over {limit} characters can); shorten it",
                       param=what.split(" ")[0], code="context_length_exceeded")


# OpenAI's defaults for a sampling field that neither the request nor the server's flags set.
_OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None}


def _params(state: ServeState, body, max_tokens: int, stop: list[str], logprobs: int | None,
            adapter: str | None = None) -> SamplingParams:
    def pick(name: str):
        given = getattr(body, name)
        return given if given is not None else state.sampling_defaults.get(name, _OPENAI_DEFAULTS[name])

    return SamplingParams(max_tokens=max_tokens, temperature=pick("temperature"), top_p=pick("top_p"),
                          top_k=max(pick("top_k"), 0), repetition_penalty=body.repetition_penalty,
                          seed=pick("seed"), stop=stop, logprobs=logprobs, adapter=adapter)


async def _collect(request: Request, run: Run) -> None:
    """Wait for every choice of a non-streamed request (cancelled if the client leaves)."""
    watch = asyncio.create_task(watch_disconnect(request, run))
    try:
        async for _ in run.events():
            pass
    except RequestTimeout:
        raise _timeout_error(run.state) from None
    finally:
        watch.cancel()
        run.close()
    if run.error:
        raise APIError(500, f"generation failed: {run.error}", type="server_error")


async def _completion_prompts(state: ServeState, body: CompletionRequest) -> tuple[list[list[int]], list[str] | None]:
    """(token-id prompts, their texts or None for token-id prompts) of a completions request."""
    p = body.prompt
    if isinstance(p, str):
        texts = [p]
    elif p and all(isinstance(x, str) for x in p):
        texts = list(p)
    else:
        return ([list(p)] if p and isinstance(p[0], int) else [list(x) for x in p]), None
    for i, t in enumerate(texts):
        _check_chars(state, t, f"prompt {i}")
    # Off the event loop: other requests' streams and /health go on while this encodes.
    # (One by one: encode_batch's thread pool would warn in every process forked later.)
    tok = state.tokenizer
    return await run_in_threadpool(lambda: [tok.encode(t) for t in texts]), texts


async def completions(body: CompletionRequest, request: Request):
    state = _state(request)
    tok = state.tokenizer
    adapter = _check_model(state, body.model)
    prompts, texts = await _completion_prompts(state, body)
    if not prompts:
        raise APIError(400, "prompt: empty list", param="prompt")
    max_tokens = body.max_tokens or state.sampling_defaults.get("max_tokens", 16)
    for i, ids in enumerate(prompts):
        _check_prompt(state, ids, max_tokens, i)
    if texts is None:  # token-id prompts: their text only for echo, once they are known to fit
        texts = [tok.decode(x) for x in prompts] if body.echo else [""] * len(prompts)
    run = Run(state, prompts, _params(state, body, max_tokens, body.stops(), body.logprobs, adapter), body.n)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": body.model}

    def prefix(i: int) -> str:
        return texts[i // body.n] if body.echo else ""

    if body.stream:
        def render(ev) -> dict:
            lp = None
            if isinstance(ev, TokenEvent) and ev.logprob is not None:
                lp = _completion_logprobs(tok, Choice(tokens=[ev.token_id], logprobs=[ev.logprob],
                                                      top=[ev.top or []]), 0)
            fin = ev.reason if isinstance(ev, FinishEvent) else None
            return {"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": fin}

        opening = ([{"index": i, "text": prefix(i), "logprobs": None, "finish_reason": None}
                    for i in range(len(run.choices))] if body.echo else [])
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return _stream(run, head, opening, render, usage)
    await _collect(request, run)
    choices = []
    for i, c in enumerate(run.choices):
        lp = _completion_logprobs(tok, c, len(prefix(i))) if body.logprobs is not None else None
        choices.append({"index": i, "text": prefix(i) + "".join(c.text), "logprobs": lp,
                        "finish_reason": c.finish_reason})
    return {**head, "choices": choices, "usage": run.usage()}


def _chat_chunk(tok, ev) -> dict:
    if isinstance(ev, TokenEvent):
        lp = _chat_logprobs(tok, [ev.token_id], [ev.logprob], [ev.top or []]) if ev.logprob is not None else None
        return {"index": ev.index, "delta": {"content": ev.text}, "logprobs": lp, "finish_reason": None}
    return {"index": ev.index, "delta": {"content": ev.text} if ev.text else {}, "logprobs": None,
            "finish_reason": ev.reason}


async def chat_completions(body: ChatRequest, request: Request):
    state = _state(request)
    tok = state.tokenizer
    adapter = _check_model(state, body.model)
    msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    _check_chars(state, "".join(m["content"] for m in msgs), "messages")
    try:
        text = await run_in_threadpool(state.chat.prompt, msgs)
    except DataError as e:  # the template refused these messages (its raise_exception)
        raise APIError(400, str(e), param="messages") from None
    _check_chars(state, text, "messages")
    ids = await run_in_threadpool(tok.encode, text)
    max_tokens = (body.max_completion_tokens or body.max_tokens or state.sampling_defaults.get("max_tokens")
                  or max(1, state.max_positions - len(ids)))
    _check_prompt(state, ids, max_tokens, 0)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    run = Run(state, [ids], _params(state, body, max_tokens, body.stops() + state.chat.stop, logprobs, adapter),
              body.n)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body.model}
    if body.stream:
        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(len(run.choices))]
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return _stream(run, {**head, "object": "chat.completion.chunk"}, opening, lambda ev: _chat_chunk(tok, ev),
                       usage)
    await _collect(request, run)
    choices = []
    for i, c in enumerate(run.choices):
        lp = _chat_logprobs(tok, c.tokens, c.logprobs, c.top) if body.logprobs else None
        choices.append({"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": lp, "finish_reason": c.finish_reason})
    return {**head, "choices": choices, "usage": run.usage()}


def create_app(state: ServeState) -> FastAPI:
    """The FastAPI application over a started engine (`state.engine`)."""
    app = FastAPI(title="gptforge serve", docs_url=None, redoc_url=None)
    app.state.serve = state
    _openai_errors(app)
    app.add_middleware(Gate, state=state, api=app)
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    app.get("/v1/models")(models)
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat_completions)
    return app
