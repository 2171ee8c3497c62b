"""Device choice (`Global.device`), shared by every stage that runs a model, and the CPU
allocator's tuning the trainer and the decode backend share.

It lives below the stages and the CLI so that train/, compress/, evaluate/ and demo/ never reach
up into `gptforge.commands` for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gptforge.errors import ConfigError, UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch


def select_device(spec: str) -> torch.device:
    """`Global.device`: auto | cpu | cuda | gpu | cuda:N."""
    import torch

    s = (spec or "auto").lower()
    if s == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if s == "gpu":
        s = "cuda"
    if s.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"Global.device: {spec!r} requested but no CUDA device is available; use -o Global.device=cpu")
        return torch.device(s)
    if s == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"Global.device: {spec!r} is not one of auto, cpu, cuda, gpu, cuda:N")


def recorded_device_here(raw: dict) -> tuple[dict, str | None]:
    """A checkpoint's config records the device its run trained on. On a machine without CUDA a
    recorded CUDA device leaves the checkpoint's layer (so `auto`, or what -c/-o say, applies: a
    model trained on a GPU evaluates and generates on a CPU box); returns (raw, the dropped device
    or None)."""
    import torch

    glob = raw.get("Global") if isinstance(raw.get("Global"), dict) else {}
    dev = glob.get("device")
    if not (isinstance(dev, str) and dev.lower().startswith(("cuda", "gpu"))) or torch.cuda.is_available():
        return raw, None
    return {**raw, "Global": {k: v for k, v in glob.items() if k != "device"}}, dev


MALLOC_ENV = "GPTFORGE_MALLOC_TUNING"


def tune_cpu_allocator() -> bool:
    """Keep freed memory in the glibc heap instead of returning it to the OS (Linux only).

    A CPU training step allocates and frees hundreds of MB (logits, softmax, gradients) every
    step, a 64-row decode step tens of MB (fbgemm's buffers, logits); by default glibc serves
    each large block with a fresh mmap, so every step pays page faults on first touch (~0.25 s
    per 400 MB here, 10-15% of a training step; a 64-row INT8 decode step 50-59 -> 44-46 ms). `mallopt`
    makes it reuse the heap instead, like the jemalloc/tcmalloc setups PyTorch recommends for CPU
    work. The process's resident size then stays at its peak. The trainer and the decode backend
    call it on CPU; `GPTFORGE_MALLOC_TUNING=0` turns it off (any value but 0 or 1: UsageError).
    """
    import ctypes
    import os
    import sys

    val = os.environ.get(MALLOC_ENV, "").strip() or "1"
    if val not in ("0", "1"):
        raise UsageError(f"environment variable {MALLOC_ENV}={val!r}: choose 1 (keep freed memory in the heap, "
                         "the default) or 0 (glibc's defaults), or unset it")
    if not sys.platform.startswith("linux") or val == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):  # not glibc (musl, ...): keep its defaults
        return False
