"""LoRA / DoRA adapters over our GPT (a transform over the model, like transforms/): layers,
injection, merging and the PEFT adapter-directory format (docs/lora.md)."""

from gptforge.adapters.inject import (
    TARGETS,
    adapter_state_dict,
    apply_lora,
    base_state_dict,
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
from gptforge.adapters.peft_format import apply_adapter, load_adapter, save_adapter

__all__ = [
    "TARGETS", "LoraHead", "LoraLinear", "LoraPair", "adapter_state_dict", "apply_adapter", "apply_lora",
    "base_state_dict", "count_parameters", "describe", "has_adapters", "load_adapter", "load_adapter_state_dict",
    "lora_layers", "lora_scaling", "merge_adapters", "save_adapter", "trainable_parameters", "unload",
]
