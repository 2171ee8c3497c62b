"""What the export formats share: what kind of model a checkpoint holds, folding its
quantization into float weights, the precision an export uses, and quiet exporters.

Kinds of model an export meets (`model_kind`):
- `float`: a plain GPT, dense or pruned (fewer heads / narrower FFNs per layer);
- `fake-quant`: a QAT or PTQ model (`QuantLinear`, optionally `QuantEmbedding`);
- `int8`: a converted INT8 model (`gptforge quantize --convert`: `Int8Linear`, `Int8Embedding`).

`fold_quantization` turns the last two into a plain float GPT holding the weights the
quantized model multiplies with (fake-quant weights = their dequantized values; INT8 weights
x steps). Activations stay float: the result equals the quantized model with activation
quantization switched off.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import torch
from torch import nn

from gptforge.errors import UsageError
from gptforge.export.export_dir import META_FILE, load_export_config, read_export_dir  # noqa: F401 - the writers' format
from gptforge.model.gpt import block_linears

FLOAT, FAKE_QUANT, INT8 = "float", "fake-quant", "int8"
PRECISIONS = ("auto", "fp32", "int8")
_QUANT_STATE = (".act_scale", ".act_accum", ".act_state", ".pact_alpha", ".weight_scale", ".input_scale")


def model_kind(model: nn.Module) -> str:
    """`float`, `fake-quant` or `int8` (see the module docstring)."""
    from gptforge.transforms.int8 import Int8Embedding, Int8Linear
    from gptforge.transforms.quant import QuantEmbedding, QuantLinear

    kinds = {type(m) for m in model.modules()}
    if kinds & {Int8Linear, Int8Embedding}:
        return INT8
    if kinds & {QuantLinear, QuantEmbedding}:
        return FAKE_QUANT
    return FLOAT


def resolve_precision(requested: str, kind: str) -> str:
    """`fp32` or `int8` for an export of a `kind` model (`auto`: int8 exactly when the model
    is quantized)."""
    if requested not in PRECISIONS:
        raise UsageError(f"--precision {requested!r}: choose one of {', '.join(PRECISIONS)}")
    if requested == "auto":
        return "int8" if kind != FLOAT else "fp32"
    if requested == "int8" and kind == FLOAT:
        raise UsageError("--precision int8 needs a quantized checkpoint (QAT, PTQ or `gptforge quantize --convert`); "
                         "this one is a float model: run `gptforge qat` / `gptforge ptq` first or export fp32")
    return requested


@torch.no_grad()
def folded_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The float state dict of `model` with quantization folded (see the module docstring)."""
    from gptforge.transforms.int8 import Int8Embedding, Int8Linear
    from gptforge.transforms.quant import QuantEmbedding, QuantLinear, fake_quant_weight

    sd = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith(_QUANT_STATE)}
    for name, mod in model.named_modules():
        key = f"{name}.weight"
        if isinstance(mod, QuantLinear):
            sd[key] = (mod.quantized_weight() if mod.weight_quant_enabled else mod.weight).detach()
        elif isinstance(mod, QuantEmbedding) and mod.weight_quant_enabled:
            sd[key] = fake_quant_weight(mod.weight.detach(), mod.weight_bits, True)
        elif isinstance(mod, (Int8Linear, Int8Embedding)):
            sd[key] = mod.dequantized_weight()
    return {k: v.float() if v.is_floating_point() or v.dtype == torch.int8 else v for k, v in sd.items()}


def fold_quantization(model: nn.Module) -> nn.Module:
    """A plain float GPT (new module, eval mode) computing what `model` computes with
    activation quantization off; a float model is returned as it is."""
    from gptforge.model import build_model
    from gptforge.model_io import load_state_dict_checked

    if model_kind(model) == FLOAT:
        return model
    plain = build_model(model.config, device="meta")
    load_state_dict_checked(plain, {k: v.clone() for k, v in folded_state_dict(model).items()}, "quantized model")
    return plain.eval()


def check_plain_linears(model: nn.Module, what: str) -> None:
    """Refuse structures an export does not know how to write (wrapped or replaced layers)."""
    from gptforge.transforms import weight_qat
    from gptforge.transforms.int8 import Int8Embedding, Int8Linear
    from gptforge.transforms.quant import QuantEmbedding, QuantLinear

    known = (nn.Linear, QuantLinear, Int8Linear)
    moe = [i for i, blk in enumerate(model.blocks) if getattr(blk, "moe", None) is not None]
    if moe:
        raise UsageError(f"blocks.{moe[0]} is a Mixture-of-Experts layer: {what} has no MoE form; the model "
                         "directory itself (model.safetensors + config.yaml) is the MoE export (docs/moe.md)")
    if weight_qat.layers(model):  # subclasses of nn.Linear / nn.Embedding: their float weights are not what runs
        raise UsageError(f"a 4-bit QAT model (Compress.Quantization.weight_only): {what} would write its float "
                         "master weights, not the rounded ones it trained for (`gptforge quantize --weights int4` makes "
                         "the weight-only model it computes)")
    for name, mod in block_linears(model):
        if not isinstance(mod, known):
            raise UsageError(f"{name} is a {type(mod).__name__}: {what} writes plain, fake-quant "
                             "and INT8 Linear layers only")
    if not isinstance(model.wte, (nn.Embedding, QuantEmbedding, Int8Embedding)):
        raise UsageError(f"wte is a {type(model.wte).__name__}: {what} cannot write it")


@contextlib.contextmanager
def quiet_exporter():
    """Silence torch.export / torch.onnx progress prints and warnings that do not concern the
    user (e.g. `torchvision is not installed. Skipping torchvision::nms`)."""
    names = ("torch.onnx", "torch.export", "torch._dynamo", "torch._export", "torch.fx.experimental.symbolic_shapes",
             "onnxscript")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lvl in zip(loggers, levels, strict=True):
            lg.setLevel(lvl)
