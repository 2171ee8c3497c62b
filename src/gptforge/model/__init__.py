"""The GPT model, its presets and checkpoint converters."""

from gptforge.model.gpt import GPT, GPTOutput, KVCache, build_model, layer_shapes, lm_loss
from gptforge.model.presets import PRESETS, reference_param_count

__all__ = ["GPT", "GPTOutput", "KVCache", "PRESETS", "build_model", "layer_shapes", "lm_loss", "reference_param_count"]
