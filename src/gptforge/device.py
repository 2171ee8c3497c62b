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
