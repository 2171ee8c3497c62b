"""The GPT model (pure PyTorch) and checkpoint layout converters; the size presets are config's (`gptforge.config.presets`)."""

from gptforge.model.gpt import (
    BLOCK_LINEARS,
    GPT,
    GPTOutput,
    KVCache,
    block_linears,
    build_model,
    layer_shapes,
    lm_loss,
)

__all__ = ["BLOCK_LINEARS", "GPT", "GPTOutput", "KVCache", "block_linears", "build_model", "layer_shapes", "lm_loss"]
