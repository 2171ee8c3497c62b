"""gptforge: pretrain, generate, evaluate, compress and export GPT models in PyTorch."""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# onnxruntime's official builds start telemetry when the library loads (a device id under
# ~/.cache/Microsoft/, upload attempts); gptforge works offline, so it is off unless the user set
# the variable. It must be set before onnxruntime is first imported: here, before any verb runs.
_os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from gptforge.errors import CheckpointError, ConfigError, DataError, GPTForgeError, UsageError

__all__ = [
    "__version__",
    "GPTForgeError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "UsageError",
]
