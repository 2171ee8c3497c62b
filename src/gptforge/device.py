"""Device choice (`Global.device`), shared by every stage that runs a model.

It lives below the stages and the CLI so that train/, compress/, evaluate/ and demo/ never reach
up into `gptforge.commands` for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gptforge.errors import ConfigError

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
