"""Data: tokenizers, preprocessing into token files, the Megatron-style dataset, the built-in corpus.

Heavy modules load on first use, so `import gptforge.data` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GPTDataset": "gptforge.data.dataset",
    "GPTBatchSampler": "gptforge.data.dataset",
    "build_datasets": "gptforge.data.dataset",
    "collate": "gptforge.data.dataset",
    "Tokenizer": "gptforge.data.tokenizer",
    "load_tokenizer": "gptforge.data.tokenizer",
    "gpt2_tokenizer": "gptforge.data.tokenizer",
    "train_tokenizer": "gptforge.data.tokenizer",
    "preprocess_files": "gptforge.data.preprocess",
    "preprocess_documents": "gptforge.data.preprocess",
    "load_token_files": "gptforge.data.indexed",
    "builtin_documents": "gptforge.data.corpus",
    "builtin_token_files": "gptforge.data.corpus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gptforge.data' has no attribute {name!r}")
