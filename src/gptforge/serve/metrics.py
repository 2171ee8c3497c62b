"""Prometheus metrics of `gptforge serve` (`GET /metrics`), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: N811
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; CPU decode steps run from a few ms (tiny models) to a second (large batches).
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class ServeMetrics:
    """Requests, tokens, queue depth, batch size, time-to-first-token and inter-token latency."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("gptforge_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.model_requests = Counter("gptforge_model_requests", "accepted requests by served model (base or adapter)",
                                      ["model"], registry=r)
        self.prompt_tokens = Counter("gptforge_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("gptforge_generation_tokens", "tokens generated", registry=r)
        self.draft_tokens = Counter("gptforge_draft_tokens", "tokens proposed by the draft model (speculative decoding)",
                                    registry=r)
        self.draft_accepted_tokens = Counter("gptforge_draft_accepted_tokens",
                                             "draft tokens the target accepted (speculative decoding)", registry=r)
        self.queue_depth = Gauge("gptforge_queue_depth", "sequences waiting for a slot", registry=r)
        self.batch_size = Gauge("gptforge_batch_size", "sequences in the running batch", registry=r)
        self.ttft = Histogram("gptforge_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("gptforge_inter_token_latency_seconds", "time between two tokens of a sequence",
                             buckets=_LATENCY_BUCKETS, registry=r)

    # -- the engine's metrics hooks (`generate.engine`: output processor, speculator, service) --

    def on_token(self, first: bool, seconds: float) -> None:
        self.generation_tokens.inc()
        (self.ttft if first else self.itl).observe(seconds)

    def on_draft(self, drafted: int, accepted: int) -> None:
        self.draft_tokens.inc(drafted)
        self.draft_accepted_tokens.inc(accepted)

    def on_queue(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.batch_size.set(running)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "ServeMetrics"]
