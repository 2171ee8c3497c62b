"""Running `gptforge serve`: the engine over a backend, the app, and uvicorn with a graceful drain.

SIGTERM (or SIGINT) starts the drain: new requests get 503 while queued and running requests
finish; after `drain_timeout` seconds whatever is left is aborted (finish_reason "abort"), then
uvicorn closes. A second signal exits at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from gptforge.adapters.multi import router_of
from gptforge.data.chat_template import template_for
from gptforge.errors import ConfigError
from gptforge.generate.backend import TorchBackend, check_kv_cache_dtype
from gptforge.generate.engine import EngineCore, EngineService, SchedulerConfig
from gptforge.generate.slots import slots_for
from gptforge.serve.app import ServeState, create_app, prompt_char_limit
from gptforge.serve.metrics import ServeMetrics


@dataclass
class ServeOptions:
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch_size: int = 16
    max_tokens_in_flight: int | None = None
    max_queue: int = 256
    prefill_tokens: int = SchedulerConfig.prefill_tokens  # prompt tokens per step beside the decodes
    drain_timeout: float = 30.0
    chat_template: str | None = None  # a template file; None: the tokenizer's own (the model's), else the default
    public_metrics: bool = False  # /metrics open without the API key
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    request_timeout: float | None = None  # seconds a request may take from arrival (None: no limit)
    # What a request that omits a sampling field gets (`gptforge serve --temperature ...`); OpenAI's
    # defaults for the fields not given here.
    sampling_defaults: dict = field(default_factory=dict)


def _open(model_or_backend, generation, closers: list):
    if isinstance(model_or_backend, torch.nn.Module):
        backend = TorchBackend(model_or_backend, prepack=generation.fast_cpu_decode,
                               kv_cache_dtype=generation.kv_cache_dtype).__enter__()
        closers.append(backend.__exit__)
        return backend
    check_kv_cache_dtype(model_or_backend, generation.kv_cache_dtype)
    return model_or_backend


def build_state(model_or_backend, tokenizer, generation, opts: ServeOptions, draft=None) -> ServeState:
    """A started engine and the app state over our model (ragged batching) or any StepBackend
    (e.g. onnxruntime: one batch-1 step per sequence). `draft` (a model or StepBackend with the
    same tokenizer, already checked) turns on speculative decoding with
    `generation.num_draft_tokens`; the target must score several tokens per step (ours, ONNX).
    Adapters loaded over our model with `adapters.multi.serve_adapters` are served by name."""
    from gptforge.generate.api import special_ids
    from gptforge.generate.speculative import parse_num_draft_tokens

    if opts.api_key is not None and not opts.api_key.strip():
        # An unset $KEY expands to "": serving without a key would be the silent result.
        raise ConfigError("the API key is empty; give a key, or leave it out to serve without one")
    closers: list = []
    backend = _open(model_or_backend, generation, closers)
    slots = slots_for(backend)
    draft_slots = draft_max = None
    if draft is not None:
        if not (slots.ragged or (hasattr(backend, "step_all") and getattr(backend, "use_cache", True))):
            raise ConfigError(f"Generation.draft={generation.draft}: the {type(backend).__name__} target cannot "
                              "score several tokens per step to verify draft tokens; unset Generation.draft")
        parse_num_draft_tokens(generation.num_draft_tokens)
        # The target itself as its own draft shares one open backend (and its packed weights).
        dbe = backend if draft is model_or_backend else _open(draft, generation, closers)
        draft_slots, draft_max = slots_for(dbe), dbe.max_positions

    def close(*exc):
        for c in reversed(closers):
            c(*exc)

    eos, _ = special_ids(generation, tokenizer.eos_token_id)
    limit = tokenizer.vocab_size if tokenizer.vocab_size < backend.vocab_size else None
    metrics = ServeMetrics()
    sched = SchedulerConfig(max_batch_size=opts.max_batch_size, max_tokens_in_flight=opts.max_tokens_in_flight,
                            max_queue=opts.max_queue, prefill_tokens=opts.prefill_tokens)
    core = EngineCore(slots, eos_token_ids=eos, vocab_limit=limit, max_positions=backend.max_positions,
                      tokenizer=tokenizer, scheduler=sched, metrics=metrics, draft_slots=draft_slots,
                      num_draft_tokens=generation.num_draft_tokens, draft_max_positions=draft_max)
    engine = EngineService(core).start()
    router = router_of(model_or_backend) if isinstance(model_or_backend, torch.nn.Module) else None
    return ServeState(engine, tokenizer, opts.model_name, backend.max_positions, backend.vocab_size, metrics,
                      template_for(tokenizer, opts.chat_template), api_key=opts.api_key, public_metrics=opts.public_metrics,
                      max_body_bytes=opts.max_body_bytes, request_timeout=opts.request_timeout,
                      max_prompt_chars=prompt_char_limit(tokenizer, backend.max_positions),
                      sampling_defaults=dict(opts.sampling_defaults),
                      adapters=list(router.names) if router is not None else [],
                      close=close if closers else None)


class DrainingServer:
    """uvicorn.Server whose exit signal drains first (see the module docstring)."""

    def __init__(self, state: ServeState, opts: ServeOptions, log_level: str = "info", on_started=None):
        """`on_started(port)` runs once the socket is bound (the real port, also for port 0)."""
        import uvicorn

        self.state, self.opts = state, opts
        config = uvicorn.Config(create_app(state), host=opts.host, port=opts.port, log_level=log_level,
                                timeout_graceful_shutdown=5, lifespan="off")
        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # noqa: ARG002
                outer.begin_drain()

            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started and on_started is not None:
                    on_started(outer.port)

        self.server = _Server(config)
        self._drain_started = False

    def begin_drain(self) -> None:
        """Stop accepting requests, let running ones finish (bounded), then stop the server."""
        if self._drain_started:  # a second signal: exit now
            self.server.force_exit = self.server.should_exit = True
            return
        self._drain_started = True
        self.state.draining = True
        self.state.engine.drain()
        threading.Thread(target=self._drain, name="gptforge-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.opts.drain_timeout
        while time.monotonic() < deadline and (self.state.inflight or not self.state.engine.idle()):
            time.sleep(0.05)
        if not self.state.engine.idle():
            self.state.engine.abort_all()
            end = time.monotonic() + 2
            while self.state.inflight and time.monotonic() < end:
                time.sleep(0.05)
        self.server.should_exit = True

    def run(self) -> None:
        try:
            self.server.run()
        finally:
            self.state.engine.stop()
            if self.state.close is not None:
                self.state.close(None, None, None)

    @property
    def started(self) -> bool:
        return self.server.started

    @property
    def port(self) -> int:
        """The port the server listens on (the bound one when `opts.port` is 0)."""
        for srv in getattr(self.server, "servers", []):
            for sock in srv.sockets:
                return sock.getsockname()[1]
        return self.opts.port


__all__ = ["DrainingServer", "ServeOptions", "build_state"]
