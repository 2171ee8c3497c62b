"""gptforge: pretrain, generate, evaluate, compress and export GPT models in PyTorch."""

from __future__ import annotations

__version__ = "0.1.0"

from gptforge.errors import CheckpointError, ConfigError, DataError, GPTForgeError, UsageError

__all__ = [
    "__version__",
    "GPTForgeError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "UsageError",
]
