"""Model compression applied from outside the model: INT8 quantization (fake-quant QAT/PTQ,
real INT8 conversion) and structured pruning.

Quantization API (see docs/qat.md, docs/ptq.md, docs/quantize.md):

    from gptforge.compress import quantize_model, calibrate, convert_model
    quantize_model(model, cfg.Compress.Quantization)     # fake-quant modules, in place
    calibrate(model, batches)                            # PTQ activation scales
    convert_model(model)                                 # real INT8 modules, in place

Layer names: ours `blocks.{i}.attn.qkv_proj|attn.out_proj|linear1|linear2`, the reference's
`linear_{4i+j}` (`reference_name`, `our_name`); `set_quant_enabled` switches one layer's weight
or activation quantization off (sensitivity analysis).
"""

from gptforge.compress.int8 import Int8Embedding, Int8Linear, convert_model, int8_structure
from gptforge.compress.ptq import calibrate, ptq
from gptforge.compress.qat import qat
from gptforge.compress.quant import (
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
    "calibrate",
    "convert_model",
    "int8_structure",
    "is_fake_quantized",
    "linear_names",
    "our_name",
    "ptq",
    "qat",
    "quant_modules",
    "quantize_model",
    "reference_name",
    "selected_layers",
    "set_quant_enabled",
]
