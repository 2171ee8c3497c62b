"""Model size presets (spec §1.5) and the reference's parameter-count formula.

Pure data: importing this module does not import torch, so configs can expand presets cheaply.
"""

from __future__ import annotations

from typing import Any

# GPT-2's BPE vocabulary: under `Data.tokenizer: gpt2` a preset's vocabulary is never smaller
# than this (resolve.apply_preset).
GPT2_VOCAB_SIZE = 50257

# Shape keys only; everything else (dropout, init, recompute) comes from the config. A preset
# also lowers the sequence lengths it inherits to its positions (resolve.preset_fills).
PRESETS: dict[str, dict[str, Any]] = {
    # Reference sizes (PaddleFleetX configs).
    "345M": dict(hidden_size=1024, num_layers=24, num_attention_heads=16, ffn_hidden_size=4096,
                 vocab_size=50304, max_position_embeddings=1024),
    "1.3B": dict(hidden_size=2048, num_layers=24, num_attention_heads=16, ffn_hidden_size=8192,
                 vocab_size=50304, max_position_embeddings=1024),
    "6.7B": dict(hidden_size=4096, num_layers=32, num_attention_heads=32, ffn_hidden_size=16384,
                 vocab_size=50304, max_position_embeddings=1024),
    "13B": dict(hidden_size=5120, num_layers=40, num_attention_heads=40, ffn_hidden_size=20480,
                vocab_size=50432, max_position_embeddings=4096),
    "175B": dict(hidden_size=12288, num_layers=96, num_attention_heads=96, ffn_hidden_size=49152,
                 vocab_size=51200, max_position_embeddings=1024),
    # GPT-2 small shape (decode benchmark, HF parity at real size).
    "124M": dict(hidden_size=768, num_layers=12, num_attention_heads=12, ffn_hidden_size=3072,
                 vocab_size=50304, max_position_embeddings=1024),
    # Small CPU presets. `small` is the shape of the CPU training benchmarks (≈30M with GPT-2 vocab);
    # `mini` and `tiny` carry the vocabulary of a trained BPE tokenizer (`gptforge tokenizer train`,
    # then -o Data.tokenizer=DIR); under Data.tokenizer: gpt2 they take GPT-2's vocabulary instead.
    "small": dict(hidden_size=384, num_layers=6, num_attention_heads=6, ffn_hidden_size=1536,
                  vocab_size=50304, max_position_embeddings=1024),
    "mini": dict(hidden_size=256, num_layers=4, num_attention_heads=4, ffn_hidden_size=1024,
                 vocab_size=8192, max_position_embeddings=512),
    "tiny": dict(hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=256,
                 vocab_size=4096, max_position_embeddings=256),
}


def reference_param_count(vocab_size: int, max_positions: int, hidden: int, layers: int,
                          ffn: int | None = None) -> int:
    """`get_model_size` of the reference: (V+S)h + L(4h²+4h) + L·4h + L(8h²+5h) + 2h.

    The reference formula assumes ffn = 4h; with another width the FFN term is generalised
    (2·h·ffn + ffn + h) so that it still equals the real parameter count of our model.
    """
    h, L = hidden, layers
    ffn = 4 * h if ffn is None else ffn
    attn = 4 * h * h + 4 * h
    norms = 4 * h
    mlp = 2 * h * ffn + ffn + h
    return (vocab_size + max_positions) * h + L * (attn + norms + mlp) + 2 * h
