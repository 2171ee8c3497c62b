"""The ranges of the sampling parameters, in one place: the `Generation.*` keys of every verb
(checked when a config loads, and by `generate.check_config`) and the fields of `gptforge serve`'s
requests (checked at the door, answered with a 400) use `sampling_error`.

Each range keeps decoding finite. A temperature or a repetition penalty near 0 divides the
logits into inf and the softmax into nan (1e-300 is 0 in float32); a huge penalty multiplies
negative logits into -inf; an infinite or nan value does either. Seeds go to a 64-bit generator
with one seed per choice (seed + i), so they stop at 2^63 - 1.
"""

from __future__ import annotations

import math

from gptforge.errors import ConfigError

SEED_MAX = 2**63 - 1
TEMPERATURE_RANGE = (0.01, 100.0)  # and exactly 0: greedy
PENALTY_RANGE = (0.01, 100.0)  # repetition_penalty; 1 = off

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "length_penalty", "seed")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sampling_error(name: str, value, max_temperature: float = TEMPERATURE_RANGE[1]) -> str | None:
    """Why `value` is not a valid `name` (one of `SAMPLING_KEYS`), or None when it is.
    `seed` may be None (unseeded); `max_temperature` narrows the range (OpenAI's API: 2)."""
    if name == "seed":
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= SEED_MAX:
            return f"must be an integer in [0, 2^63 - 1 = {SEED_MAX}], got {value!r}"
        return None
    if not _number(value) or not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if name == "temperature":
        lo, hi = TEMPERATURE_RANGE[0], min(max_temperature, TEMPERATURE_RANGE[1])
        if value != 0 and not lo <= value <= hi:
            return f"must be 0 (greedy) or in [{lo:g}, {hi:g}], got {value!r}"
    elif name == "top_p":
        if not 0.0 < value <= 1.0:
            return f"must be in (0, 1] (1 = off), got {value!r}"
    elif name == "top_k":
        if not isinstance(value, int) or value < 0:
            return f"must be an integer >= 0 (0 = off), got {value!r}"
    elif name == "repetition_penalty":
        lo, hi = PENALTY_RANGE
        if not lo <= value <= hi:
            return f"must be in [{lo:g}, {hi:g}] (1 = off), got {value!r}"
    elif name != "length_penalty":  # length_penalty: any finite exponent
        raise KeyError(name)
    return None


def check_sampling(section, prefix: str = "Generation") -> None:
    """Raise `ConfigError` naming the first `prefix.key` of `section` (a GenerationConfig) out of range."""
    for key in SAMPLING_KEYS:
        msg = sampling_error(key, getattr(section, key))
        if msg:
            raise ConfigError(f"{prefix}.{key}: {msg}")


# `Generation.kv_cache_dtype`: what the KV cache stores keys/values in (auto: the model's dtype).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
_KV_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}


def kv_cache_dtype_name(value, prefix: str = "Generation") -> str:
    """The canonical `kv_cache_dtype` (fp32 / bf16 spellings accepted), or `ConfigError` naming the key."""
    name = str(value).strip().lower()
    name = _KV_ALIASES.get(name, name)
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"{prefix}.kv_cache_dtype: {value!r} is not one of {', '.join(KV_CACHE_DTYPES)}; "
                          "give e.g. bfloat16 (half the KV bytes) or int8 (about a quarter)")
    return name


def check_kv_cache_dtype(section, prefix: str = "Generation") -> None:
    """Normalize `section.kv_cache_dtype` in place (or raise `ConfigError` naming the key)."""
    section.kv_cache_dtype = kv_cache_dtype_name(getattr(section, "kv_cache_dtype", "auto"), prefix)
