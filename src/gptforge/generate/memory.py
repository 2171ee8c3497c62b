"""Will a decode fit? Checked before any allocation, so an impossible `num_beams` or
`num_return_sequences` is one line naming the key instead of an OOM kill.

Every decoded row (a beam, or a returned sequence) holds a KV cache of `2 · Σ heads · head_dim`
values per position (in `Generation.kv_cache_dtype`: 4, 2 or 1 byte each, int8 plus a float32
scale per head), and beam search copies the whole cache when it reorders beams (the old
and the new copy live together for a moment). Each step also holds a few `[rows, vocabulary]`
float32 buffers (logits, log-softmax, candidate scores).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from gptforge.config.schema import GenerationConfig
from gptforge.errors import ConfigError
from gptforge.model import kv_cache

# float32 [rows, vocabulary] buffers alive at once in a step (logits, log-softmax, processed
# scores, candidates) and copies of the KV cache during a beam reorder.
_VOCAB_BUFFERS, _BEAM_CACHE_COPIES = 4, 2


def kv_bytes_per_position(backend) -> int | None:
    """Bytes of keys + values one row adds per position (in the cache's storage dtype:
    `Generation.kv_cache_dtype`), or None when the backend does not say."""
    model = getattr(backend, "model", None)
    if model is not None and hasattr(model, "blocks") and hasattr(model, "wte"):
        heads = sum(blk.attn.qkv_proj.out_features // (3 * blk.attn.head_dim) for blk in model.blocks)
        dtype = getattr(backend, "kv_dtype", None)
        if dtype is None:  # the model's own: its float dtype (an INT8 model's embedding is int8, its cache fp32)
            w = model.wte.weight
            dtype = w.dtype if w.is_floating_point() else model.wpe.weight.dtype
        return kv_cache.kv_bytes_per_position(heads, int(model.config.head_dim), dtype)
    if hasattr(backend, "heads") and hasattr(backend, "head_dim"):  # onnxruntime: float32 past keys/values
        return kv_cache.kv_bytes_per_position(sum(backend.heads), int(backend.head_dim), torch.float32)
    return None


def decode_bytes(backend, cfg: GenerationConfig, batch_size: int, prompt_len: int) -> int | None:
    """Estimated peak bytes of decoding `batch_size` prompts of `prompt_len` tokens."""
    per_pos = kv_bytes_per_position(backend)
    if per_pos is None:
        return None
    beam = cfg.decode_strategy == "beam_search"
    rows = batch_size * (cfg.num_beams if beam else cfg.num_return_sequences)
    positions = prompt_len + cfg.max_dec_len
    kv = rows * positions * per_pos * (_BEAM_CACHE_COPIES if beam else 1)
    vocab = rows * int(backend.vocab_size) * 4 * _VOCAB_BUFFERS
    history = rows * positions * 8 * 3  # token history, masks, candidate sequences (int64)
    return kv + vocab + history


def _cgroup_room() -> int | None:
    """Bytes left under a cgroup v2 memory limit (containers), or None without one."""
    root = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError, ValueError):
        limit = (root / "memory.max").read_text().strip()
        if limit != "max":
            return max(0, int(limit) - int((root / "memory.current").read_text()))
    return None


def available_memory(device: torch.device | str) -> int | None:
    """Bytes free for new tensors on `device` (MemAvailable / cgroup room on CPU, free memory on
    CUDA), or None when it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            return int(torch.cuda.mem_get_info(device)[0])
        return None
    if device.type != "cpu":
        return None
    found: list[int] = []
    try:
        import psutil

        found.append(int(psutil.virtual_memory().available))
    except ImportError:
        with contextlib.suppress(OSError, ValueError, StopIteration):
            text = Path("/proc/meminfo").read_text()
            line = next(x for x in text.splitlines() if x.startswith("MemAvailable:"))
            found.append(int(line.split()[1]) * 1024)
    room = _cgroup_room() if os.name == "posix" else None
    if room is not None:
        found.append(room)
    return min(found) if found else None


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_decode_fits(backend, cfg: GenerationConfig, batch_size: int, prompt_len: int,
                      vocab_limit: int | None = None) -> None:
    """ConfigError naming the key when `num_beams` exceeds the vocabulary, or when the beams /
    returned sequences would need more memory than the device has free."""
    vocab = min(int(backend.vocab_size), vocab_limit or int(backend.vocab_size))
    beam = cfg.decode_strategy == "beam_search"
    if beam and cfg.num_beams > vocab:
        raise ConfigError(f"Generation.num_beams={cfg.num_beams}: more beams than the vocabulary has tokens "
                          f"({vocab}); use at most {vocab} (a few, e.g. 4, is usual)")
    need = decode_bytes(backend, cfg, batch_size, prompt_len)
    free = available_memory(backend.device)
    if need is None or free is None or need <= free:
        return
    key, n = ("num_beams", cfg.num_beams) if beam else ("num_return_sequences", cfg.num_return_sequences)
    rows = batch_size * n
    raise ConfigError(
        f"Generation.{key}={n}: decoding {rows} rows ({batch_size} prompts x {n}) of up to "
        f"{prompt_len + cfg.max_dec_len} positions needs about {_gb(need)} (KV cache + vocabulary buffers) but "
        f"{_gb(free)} is free on {backend.device}; lower Generation.{key}, --batch-size or Generation.max_dec_len"
    )
