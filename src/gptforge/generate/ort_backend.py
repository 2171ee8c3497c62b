"""An inference backend: an exported ONNX model in onnxruntime as a `StepBackend` for the engine
and beam search, so every Generation option works and greedy output equals PyTorch's.

    from gptforge.generate.ort_backend import load_onnx_dir
    backend, cfg, tokenizer = load_onnx_dir("out/onnx")
    res = generate(backend, tokenizer, ["Hello"], cfg.Generation)

The cache is the list of `present_*` arrays the previous step returned, fed back as `past_*`.
The session and its INT8 GEMM choice come from `export/ort_session.py`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from gptforge.errors import CheckpointError
from gptforge.export.export_dir import META_FILE, load_export_config, read_export_dir
from gptforge.export.ort_session import make_session


class OrtCache:
    """past_* arrays, [B, heads_i, past, head_dim] each, key then value per layer."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays

    @property
    def length(self) -> int:
        return int(self.arrays[0].shape[2])


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.int64, copy=False)


class OrtBackend:
    """`gptforge.generate.StepBackend` over an exported ONNX model (see the module docstring)."""

    def __init__(self, model_path: str | os.PathLike, meta: dict, *, int8_gemm: str = "auto",
                 threads: int | None = None):
        self.meta = meta
        self.device = torch.device("cpu")
        self.vocab_size = int(meta["vocab_size"])
        self.max_positions = int(meta["max_positions"])
        self.heads = [int(h) for h in meta["layer_heads"]]
        self.head_dim = int(meta["head_dim"])
        self.session, self.int8_gemm = make_session(model_path, meta, int8_gemm=int8_gemm, threads=threads)
        self.input_names = [i.name for i in self.session.get_inputs()]
        if self.input_names != list(meta["inputs"]):
            raise CheckpointError(f"{model_path}: its inputs ({', '.join(self.input_names[:5])}, ...) are not the "
                                  f"ones {META_FILE} describes; re-export the model")

    def new_cache(self, batch_size: int, max_len: int) -> OrtCache:
        del max_len  # the cache grows by concatenation
        arrays = []
        for h in self.heads:
            z = np.zeros((batch_size, h, 0, self.head_dim), dtype=np.float32)
            arrays += [z, z]
        return OrtCache(arrays)

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
             cache: OrtCache) -> torch.Tensor:
        return self._run(input_ids, position_ids, attention_mask, cache, last_only=True)[:, -1]

    def step_all(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 cache: OrtCache) -> torch.Tensor:
        """Logits of every new position, [B, T, V] (speculative decoding's verification)."""
        return self._run(input_ids, position_ids, attention_mask, cache, last_only=False)

    def _run(self, input_ids, position_ids, attention_mask, cache: OrtCache, last_only: bool) -> torch.Tensor:
        B, T = input_ids.shape
        mask = np.ones((B, cache.length + T), dtype=np.int64) if attention_mask is None else _np(attention_mask)
        index = np.array([T - 1], dtype=np.int64) if last_only else np.arange(T, dtype=np.int64)
        feeds: dict[str, Any] = {"input_ids": _np(input_ids), "position_ids": _np(position_ids),
                                 "attention_mask": mask, "logits_index": index}
        feeds.update(zip(self.input_names[4:], cache.arrays, strict=True))
        out = self.session.run(None, feeds)
        cache.arrays = out[1:]
        return torch.from_numpy(out[0])

    def reorder(self, cache: OrtCache, index: torch.Tensor) -> OrtCache:
        idx = index.detach().cpu().numpy()
        cache.arrays = [a[idx] for a in cache.arrays]
        return cache


def load_onnx_dir(path: str | os.PathLike, cfg=None, *, int8_gemm: str = "auto", threads: int | None = None):
    """(OrtBackend, config, tokenizer) from a `gptforge export --format onnx` directory.
    `cfg` (optional) replaces the directory's config.yaml (its Generation section matters)."""
    from gptforge.data.tokenizer import load_tokenizer

    p, meta = read_export_dir(path, "onnx")
    if cfg is None:
        cfg = load_export_config(p)
    backend = OrtBackend(p / "model.onnx", meta, int8_gemm=int8_gemm, threads=threads)
    # The export's own tokenizer files first: Data.tokenizer may name a path of another machine.
    own = (p / "tokenizer.json").is_file() or (p / "vocab.json").is_file()
    return backend, cfg, load_tokenizer(None, p) if own else load_tokenizer(cfg.Data.tokenizer)
