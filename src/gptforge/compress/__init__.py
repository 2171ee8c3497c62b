"""Compression runs: the stages that train, calibrate or measure with the module swaps of
`gptforge.transforms` — QAT (`qat`), PTQ (`ptq`, `calibrate`), the real INT8 conversion of a
checkpoint (`int8_convert`), prune + fine-tune (`prune_run`) and per-layer sensitivity analysis
(`sensitivity*`).

    from gptforge.compress import calibrate
    from gptforge.transforms import convert_model, quantize_model
    quantize_model(model, cfg.Compress.Quantization)     # fake-quant modules, in place
    calibrate(model, batches)                            # PTQ activation scales
    convert_model(model)                                 # real INT8 modules, in place
"""

from gptforge.compress.ptq import calibrate, ptq
from gptforge.compress.qat import qat

__all__ = ["calibrate", "ptq", "qat"]
