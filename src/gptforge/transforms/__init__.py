"""Module swaps applied to a built model from outside it: fake quantization (`quant`), real INT8
modules (`int8`, with `cpu_kernels` choosing the exact kernels of this CPU), 2:4 sparsity
(`sparsity`) and structured pruning surgery (`prune`, scored by `prune_scores`).

They sit below `model_io` and `export` (which rebuild and write swapped models) and above the
model; the runs that train or calibrate with them are in `gptforge.compress`.

    from gptforge.transforms import quantize_model, convert_model
    quantize_model(model, cfg.Compress.Quantization)     # fake-quant modules, in place
    convert_model(model)                                 # real INT8 modules, in place

Layer names: ours `blocks.{i}.attn.qkv_proj|attn.out_proj|linear1|linear2`, the reference's
`linear_{4i+j}` (`reference_name`, `our_name`); `set_quant_enabled` switches one layer's weight
or activation quantization off (sensitivity analysis).
"""

from gptforge.transforms.int8 import Int8Embedding, Int8Linear, convert_model, int8_structure
from gptforge.transforms.quant import (
    QuantEmbedding,
    QuantLinear,
    is_fake_quantized,
    linear_names,
    our_name,
    quant_modules,
    quantize_model,
    reference_name,
    selected_layers,
    set_quant_enabled,
)

__all__ = [
    "Int8Embedding",
    "Int8Linear",
    "QuantEmbedding",
    "QuantLinear",
    "convert_model",
    "int8_structure",
    "is_fake_quantized",
    "linear_names",
    "our_name",
    "quant_modules",
    "quantize_model",
    "reference_name",
    "selected_layers",
    "set_quant_enabled",
]
