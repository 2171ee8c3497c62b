"""`SamplingParams`: how one request is decoded, the one sampling type of every client (generate,
stream, infer, the lm-eval adapter, serve). `GenerationConfig` maps onto it in one function.

A request names its model variant through `adapter`: a LoRA adapter served by name over the
base (adapters.multi; the runner hands it to the slots per segment). The KV cache dtype and
low-bit weights belong to the slots / backend, not here (issue #32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gptforge.config.schema import GenerationConfig


@dataclass
class SamplingParams:
    """Decoding settings of one request (every sequence of it)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    min_tokens: int = 0  # EOS is forbidden before this many new tokens
    seed: int | None = None  # choice j samples with its own generator seeded seed + j; None: torch's global RNG
    stop: list[str] = field(default_factory=list)  # stop strings (the text is cut before them)
    logprobs: int | None = None  # None: none; k: the chosen token's log-prob and the k best
    n: int = 1  # sequences per prompt
    adapter: str | None = None  # the served LoRA adapter to decode with (None: the base); see the module docstring

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def from_generation(cfg: GenerationConfig, max_tokens: int | None = None) -> SamplingParams:
    """The `SamplingParams` of a `Generation` section (greedy_search or sampling; beam search is
    its own algorithm and does not come here)."""
    greedy = cfg.decode_strategy == "greedy_search"
    return SamplingParams(max_tokens=int(max_tokens if max_tokens is not None else cfg.max_dec_len),
                          temperature=0.0 if greedy else float(cfg.temperature), top_p=float(cfg.top_p),
                          top_k=int(cfg.top_k), repetition_penalty=float(cfg.repetition_penalty),
                          min_tokens=int(cfg.min_dec_len), seed=cfg.seed, n=int(cfg.num_return_sequences))
