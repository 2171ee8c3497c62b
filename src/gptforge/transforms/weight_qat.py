"""Weight-only fake quantization for 4-bit QAT, on the grid of `gptforge quantize --weights`.

With `Compress.Quantization.weight_only: true`, `quant.quantize_model` swaps every block Linear
for a `WeightQuantLinear` and the tied embedding / LM head for a `WeightQuantEmbedding` (unless
`head_bits` is 32). Their forward uses `lowbit.fake_quantize`: the weight rounded to nearest in
groups of `group_size` input columns at `weight_bits` (`head_bits` for the head), symmetric or
not (`weight_sym`), exactly as `lowbit.quantize_rtn` rounds it, then dequantized; the gradient is
the straight-through estimator. Activations stay float. So rounding the trained float weights
once more (`gptforge quantize --weights int4` of the QAT checkpoint, round-to-nearest) gives a
weight-only model that computes the fake-quant model's numbers
(`compress.weight_only_run.qat_weight_spec`).

The state dict is the float model's (the master weights): a float checkpoint loads into the
fake-quant model and back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gptforge.config.schema import QuantizationConfig
from gptforge.errors import ConfigError
from gptforge.transforms import lowbit
from gptforge.transforms.head import install_head

WEIGHT_BITS = (4, 8)
HEAD_BITS = (4, 8, 16, 32)  # 16: bf16, 32: float (not quantized)
GROUP_SIZES = (0, 32, 64, 128, 256)  # 0: one scale per output row
_KEY = "Compress.Quantization"


def validate(q: QuantizationConfig) -> None:
    """ConfigError naming the key for a weight-only setting the int4/int8 format cannot hold."""
    def bad(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{_KEY}.{key}: {msg}")

    if q.weight_bits not in WEIGHT_BITS:
        raise bad("weight_bits", f"{q.weight_bits}: weight-only QAT trains for 4 or 8 bits (int4 / int8 weights)")
    if q.group_size not in GROUP_SIZES:
        raise bad("group_size", f"{q.group_size} is not one of {', '.join(map(str, GROUP_SIZES))} "
                                "(input columns per scale; 0 = one per row)")
    if q.head_bits not in HEAD_BITS:
        raise bad("head_bits", f"{q.head_bits} is not one of 4, 8, 16 (bf16), 32 (float)")
    if q.activation_preprocess_type is not None:
        raise bad("activation_preprocess_type", "PACT clips activations, which stay float with weight_only: "
                                                "leave it blank")
    if q.quantize_embedding:
        raise bad("quantize_embedding", "with weight_only the head's bits are head_bits; leave it false")
    if q.skip_tensor_map or q.skip_layers:
        key = "skip_tensor_map" if q.skip_tensor_map else "skip_layers"
        raise bad(key, "weight-only QAT rounds every block Linear (the weight-only format has no float "
                       "block layers); leave it empty")


class WeightQuantLinear(nn.Linear):
    """An `nn.Linear` whose weight is fake-quantized on the weight-only grid (activations float)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int = 4,
                 group_size: int = 64, sym: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.weight_bits, self.group_size, self.sym = bits, group_size, sym

    @classmethod
    def from_linear(cls, lin: nn.Linear, bits: int, group_size: int, sym: bool) -> WeightQuantLinear:
        """Sharing `lin`'s weight and bias Parameters (no copy; works on meta)."""
        mod = cls(lin.in_features, lin.out_features, lin.bias is not None, bits=bits, group_size=group_size, sym=sym,
                  device="meta")
        mod.weight, mod.bias = lin.weight, lin.bias
        mod.train(lin.training)
        return mod

    def quantized_weight(self) -> torch.Tensor:
        return lowbit.fake_quantize(self.weight, self.weight_bits, self.group_size, self.sym)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.quantized_weight()
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {_fmt(self.weight_bits, self.group_size, self.sym)} (weight-only fake quant)"


class WeightQuantEmbedding(nn.Embedding):
    """The tied word embedding / LM head fake-quantized on the weight-only grid, in the lookup and
    in the head (`project`, which `install_head` makes the model's `logits`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, bits: int = 8, group_size: int = 64,
                 sym: bool = True, device=None, dtype=None):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.weight_bits, self.group_size, self.sym = bits, group_size, sym

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, bits: int, group_size: int, sym: bool) -> WeightQuantEmbedding:
        mod = cls(emb.num_embeddings, emb.embedding_dim, bits=bits, group_size=group_size, sym=sym, device="meta")
        mod.weight = emb.weight
        return mod

    def quantized_weight(self) -> torch.Tensor:
        return lowbit.fake_quantize(self.weight, self.weight_bits, self.group_size, self.sym)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Groups lie within a row, so quantizing only the rows read is exact (and cheap).
        rows = F.embedding(ids, self.weight).reshape(-1, self.embedding_dim)
        out = lowbit.fake_quantize(rows, self.weight_bits, self.group_size, self.sym)
        return out.to(self.weight.dtype).reshape(*ids.shape, self.embedding_dim)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.quantized_weight().to(hidden.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {_fmt(self.weight_bits, self.group_size, self.sym)} (weight-only fake quant)"


def _fmt(bits: int, group_size: int, sym: bool) -> str:
    if bits == 16:
        return "bf16"
    return f"int{bits} {'sym' if sym else 'asym'} {'g' + str(group_size) if group_size else 'per row'}"


def _check_shapes(model: nn.Module, q: QuantizationConfig) -> None:
    from gptforge.model.gpt import block_linears

    g = q.group_size
    layers = [(n, m.in_features) for n, m in block_linears(model)] + [("wte (embedding / head)",
                                                                      model.wte.embedding_dim)]
    for name, cols in layers:
        if g and cols % g or cols % 2:
            raise ConfigError(f"{_KEY}.group_size: {name} has {cols} input columns, not a multiple of {g or 2}; "
                              "choose a group size that divides the hidden and FFN sizes")


def apply(model: nn.Module, q: QuantizationConfig) -> nn.Module:
    """Swap every block Linear (and the head, unless head_bits is 32) for its weight-only
    fake-quant form, in place; `q` validated by `quant.validate_config`."""
    from gptforge.model.gpt import block_linears

    _check_shapes(model, q)
    for name, lin in list(block_linears(model)):
        if type(lin) is not nn.Linear:
            raise TypeError(f"{name}: expected nn.Linear, found {type(lin).__name__}")
        model.set_submodule(name, WeightQuantLinear.from_linear(lin, q.weight_bits, q.group_size, q.weight_sym))
    if q.head_bits != 32:
        model.wte = WeightQuantEmbedding.from_embedding(model.wte, q.head_bits, q.group_size, q.weight_sym)
        install_head(model)
    return model


def layers(model: nn.Module) -> list[nn.Module]:
    """The weight-only fake-quant modules of `model`."""
    return [m for m in model.modules() if isinstance(m, (WeightQuantLinear, WeightQuantEmbedding))]
