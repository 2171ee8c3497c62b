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
fake-quant model and back. With `learn_scales` each quantized layer also holds its groups' scales
(`weight_log_scale`, trained with `scale_lr_mult`, never decayed) and integer zeros
(`weight_qzero`), started at `lowbit.clip_search`'s grid; the forward is
`lowbit.fake_quantize_learned` and `grid()` gives the integers and scales a converted model
stores, so it again computes the fake-quant model's numbers.
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
    if q.scale_lr_mult < 0:
        raise bad("scale_lr_mult", f"must be >= 0, got {q.scale_lr_mult}")
    if q.skip_tensor_map or q.skip_layers:
        key = "skip_tensor_map" if q.skip_tensor_map else "skip_layers"
        raise bad(key, "weight-only QAT rounds every block Linear (the weight-only format has no float "
                       "block layers); leave it empty")


class _Grid:
    """The weight's grid, shared by both modules: round-to-nearest's (recomputed from the weight at
    every step) or, after `learn_scales`, per-group scales that are parameters of their own."""

    weight: nn.Parameter
    weight_bits: int
    group_size: int
    sym: bool

    def _no_scales(self) -> None:
        self.register_parameter("weight_log_scale", None)
        self.register_buffer("weight_qzero", None)

    def learn_scales(self, lr_mult: float) -> None:
        """Give the groups trained scales, started at `clip_search`'s (left empty on meta: a
        checkpoint fills them)."""
        if self.weight_bits >= 16:
            return
        w = self.weight
        rows, cols = w.shape
        if w.device.type == "meta":
            scale = zero = torch.empty(rows, cols // (self.group_size or cols), device="meta")
        else:
            scale, zero = lowbit.clip_search(w, self.weight_bits, self.group_size, self.sym)
        self.weight_log_scale = nn.Parameter(scale.log())
        self.weight_log_scale.lr_mult = self.scale_lr_mult = lr_mult
        self.weight_qzero = zero

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # load_state_dict(assign=True) swaps in a new Parameter: keep the optimizer's multiplier.
        if self.weight_log_scale is not None:
            self.weight_log_scale.lr_mult = self.scale_lr_mult

    def quantized_weight(self) -> torch.Tensor:
        return self._fake_quantize(self.weight, self.weight_log_scale, self.weight_qzero)

    def _fake_quantize(self, w, log_scale, zero) -> torch.Tensor:
        if log_scale is None:
            return lowbit.fake_quantize(w, self.weight_bits, self.group_size, self.sym)
        return lowbit.fake_quantize_learned(w, log_scale, zero, self.weight_bits, self.group_size)

    def grid(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(q int8, scale, zero) of the learned grid, as `gptforge quantize` stores them; None
        without learned scales (round-to-nearest's grid)."""
        if self.weight_log_scale is None:
            return None
        with torch.no_grad():
            q, scale = lowbit.learned_grid(self.weight, self.weight_log_scale, self.weight_qzero, self.weight_bits,
                                           self.group_size)
        return q.to(torch.int8), scale, self.weight_qzero.clone()


class WeightQuantLinear(_Grid, nn.Linear):
    """An `nn.Linear` whose weight is fake-quantized on the weight-only grid (activations float)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int = 4,
                 group_size: int = 64, sym: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.weight_bits, self.group_size, self.sym = bits, group_size, sym
        self._no_scales()

    @classmethod
    def from_linear(cls, lin: nn.Linear, bits: int, group_size: int, sym: bool) -> WeightQuantLinear:
        """Sharing `lin`'s weight and bias Parameters (no copy; works on meta)."""
        mod = cls(lin.in_features, lin.out_features, lin.bias is not None, bits=bits, group_size=group_size, sym=sym,
                  device="meta")
        mod.weight, mod.bias = lin.weight, lin.bias
        mod.train(lin.training)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.quantized_weight()
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {_fmt(self.weight_bits, self.group_size, self.sym, self.weight_log_scale)}"


class WeightQuantEmbedding(_Grid, nn.Embedding):
    """The tied word embedding / LM head fake-quantized on the weight-only grid, in the lookup and
    in the head (`project`, which `install_head` makes the model's `logits`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, bits: int = 8, group_size: int = 64,
                 sym: bool = True, device=None, dtype=None):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.weight_bits, self.group_size, self.sym = bits, group_size, sym
        self._no_scales()

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, bits: int, group_size: int, sym: bool) -> WeightQuantEmbedding:
        mod = cls(emb.num_embeddings, emb.embedding_dim, bits=bits, group_size=group_size, sym=sym, device="meta")
        mod.weight = emb.weight
        return mod

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Groups lie within a row, so quantizing only the rows read is exact (and cheap).
        rows = F.embedding(ids, self.weight).reshape(-1, self.embedding_dim)
        scales = None if self.weight_log_scale is None else (
            F.embedding(ids, self.weight_log_scale).reshape(len(rows), -1),
            F.embedding(ids, self.weight_qzero).reshape(len(rows), -1))
        out = self._fake_quantize(rows, *(scales or (None, None)))
        return out.to(self.weight.dtype).reshape(*ids.shape, self.embedding_dim)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.quantized_weight().to(hidden.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {_fmt(self.weight_bits, self.group_size, self.sym, self.weight_log_scale)}"


def _fmt(bits: int, group_size: int, sym: bool, log_scale=None) -> str:
    if bits == 16:
        return "bf16 (weight-only fake quant)"
    learned = ", learned scales" if log_scale is not None else ""
    return (f"int{bits} {'sym' if sym else 'asym'} {'g' + str(group_size) if group_size else 'per row'} "
            f"(weight-only fake quant{learned})")


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
    if q.learn_scales:
        for mod in layers(model):
            mod.learn_scales(q.scale_lr_mult)
    return model


def layers(model: nn.Module) -> list[nn.Module]:
    """The weight-only fake-quant modules of `model`."""
    return [m for m in model.modules() if isinstance(m, (WeightQuantLinear, WeightQuantEmbedding))]
