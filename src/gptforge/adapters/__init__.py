"""LoRA / DoRA adapters over our GPT (a transform over the model, like compress/): layers,
injection, merging and the PEFT adapter-directory format (docs/lora.md)."""

from gptforge.adapters.inject import (
    TARGETS,
    adapter_state_dict,
    apply_lora,
    count_parameters,
    describe,
    has_adapters,
    load_adapter_state_dict,
    lora_layers,
    merge_adapters,
    trainable_parameters,
    unload,
)
from gptforge.adapters.layers import LoraHead, LoraLinear, LoraPair, lora_scaling

__all__ = [
    "TARGETS", "LoraHead", "LoraLinear", "LoraPair", "adapter_state_dict", "apply_lora", "count_parameters",
    "describe", "has_adapters", "load_adapter_state_dict", "lora_layers", "lora_scaling", "merge_adapters",
    "trainable_parameters", "unload",
]
