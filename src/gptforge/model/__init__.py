"""The GPT model (pure PyTorch) and checkpoint layout converters; the size presets are config's (`gptforge.config.presets`)."""

from gptforge.model.gpt import GPT, GPTOutput, KVCache, build_model, layer_shapes, lm_loss

__all__ = ["GPT", "GPTOutput", "KVCache", "build_model", "layer_shapes", "lm_loss"]
