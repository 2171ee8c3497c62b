"""Pruned models as HF `transformers` GPT-2 directories: the writer lives in
`gptforge.export.hf` (it also handles dense and quantized models, sharding and the
generation config); these names stay for `gptforge prune --hf-out` and existing callers."""

from __future__ import annotations

from gptforge.export.hf import padded_state_dict, save_pruned_hf_dir

__all__ = ["padded_state_dict", "save_pruned_hf_dir"]
