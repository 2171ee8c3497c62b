"""LoRA / DoRA layers over our Linears and the tied head, with peft's numerics.

A `LoraPair` is one low-rank update of a weight block W [out, in]: `A` [r, in], `B` [out, r],
scaling s = alpha/r (alpha/√r with rsLoRA), input dropout, and with DoRA a magnitude `m`
[out]. On a layer output y = base(x) it adds (peft `LoraLayer` / `DoraLinearLayer`):

    LoRA:  y + s·B·A·drop(x)
    DoRA:  y + (m/n − 1)·(y − b) + (m/n)·s·B·A·x,     n = ‖W + s·B·A‖ per output row (detached)

(in training with dropout, DoRA's (m/n − 1) term uses W·drop(x), as peft does.)

`LoraLinear` wraps a block Linear of any kind (`nn.Linear`, fake-quant `QuantLinear`, real
`Int8Linear`) as `base` and holds its pairs in `adapters`: `full` over every output row, or
for the fused QKV projection `q` / `k` / `v` each over its slice of the per-head grouped rows
[q_h0 k_h0 v_h0 q_h1 …] (chosen separately, each with its own rank). W is the weight the base
multiplies with (fake-quant: the quantized weight; INT8: int8 × step), so an adapter over an
INT8 base adds a float delta to the INT8 output. The INT8 kernels have no gradient of their
own, so the input gradient is taken through the dequantized weight with the activation
quantizer's straight-through mask (what the fake-quant layer computes).

`LoraHead` replaces the tied word embedding `wte` (lookups unchanged) and adds its pair to
the vocabulary projection: logits = h·Wₑᵀ + s·B·A·h. The tied weight itself never changes,
so a head adapter cannot be merged (that would change the input embedding too).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gptforge.transforms.int8 import Int8Embedding, Int8Linear
from gptforge.transforms.quant import EPS, QuantEmbedding, QuantLinear, fake_quant_weight, qmax_for

QKV_SLICES = ("q", "k", "v")
FULL = "full"
INITS = ("kaiming", "gaussian")


def lora_scaling(alpha: float, r: int, rslora: bool) -> float:
    """alpha/r, or alpha/√r with rank-stabilized LoRA (peft `use_rslora`)."""
    return alpha / math.sqrt(r) if rslora else alpha / r


def effective_weight(mod: nn.Module) -> torch.Tensor:
    """The float weight [out, in] a Linear or embedding multiplies with (quantization folded)."""
    if isinstance(mod, QuantLinear):
        return mod.quantized_weight() if mod.weight_quant_enabled else mod.weight
    if isinstance(mod, QuantEmbedding):
        return fake_quant_weight(mod.weight, mod.weight_bits, True) if mod.weight_quant_enabled else mod.weight
    if isinstance(mod, (Int8Linear, Int8Embedding)):
        return mod.dequantized_weight()
    return mod.weight


def slice_rows(t: torch.Tensor, head_dim: int | None, name: str) -> torch.Tensor:
    """Slice `name`'s rows (q, k or v of every head, in head order) of a per-head grouped fused
    QKV tensor [3·heads·head_dim, ...]; all rows for `full`."""
    if name == FULL:
        return t
    return t.reshape(-1, 3, head_dim, *t.shape[1:])[:, QKV_SLICES.index(name)].reshape(-1, *t.shape[1:])


class LoraPair(nn.Module):
    """One LoRA (or DoRA) update of a weight block [out, in]; see the module docstring."""

    def __init__(self, in_features: int, out_features: int, r: int, alpha: float, rslora: bool = False,
                 dropout: float = 0.0, dora: bool = False, device=None):
        super().__init__()
        self.r, self.alpha, self.rslora, self.dropout_p = r, float(alpha), bool(rslora), float(dropout)
        self.scaling = lora_scaling(self.alpha, r, self.rslora)
        self.lora_A = nn.Parameter(torch.zeros(r, in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r, device=device))
        self.magnitude = nn.Parameter(torch.ones(out_features, device=device)) if dora else None

    @property
    def dora(self) -> bool:
        return self.magnitude is not None

    @torch.no_grad()
    def reset(self, init: str, weight: torch.Tensor | None = None) -> None:
        """A as peft initialises it (kaiming-uniform a=√5, or N(0, 1/r)), B = 0, and DoRA's
        magnitude = the row norms of the base weight (so the adapter starts as the identity)."""
        if init == "gaussian":
            nn.init.normal_(self.lora_A, std=1.0 / self.r)
        else:
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)
        if self.magnitude is not None and weight is not None:
            self.magnitude.copy_(self.row_norm(weight))

    def delta_weight(self) -> torch.Tensor:
        """s·B·A [out, in]."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def row_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """‖W + s·B·A‖ per output row, detached (DoRA §4.3: no gradient through the norm)."""
        w = weight.detach().float() + self.scaling * (self.lora_B.detach() @ self.lora_A.detach())
        return torch.linalg.norm(w, dim=1)

    def low_rank(self, x: torch.Tensor) -> torch.Tensor:
        """B·A·x (unscaled). A decoding backend may replace it on the instance with packed-weight
        GEMMs whose per-row results do not depend on the row count (generate.backend)."""
        return F.linear(F.linear(x, self.lora_A), self.lora_B)

    def forward(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """y (the base output over this block's rows) plus this update."""
        drop = self.training and self.dropout_p > 0
        x = x.to(self.lora_A.dtype)
        xd = F.dropout(x, self.dropout_p, True) if drop else x
        lora = self.low_rank(xd)
        if self.magnitude is None:
            return y + (lora * self.scaling).to(y.dtype)
        scale = self.magnitude / self.row_norm(weight)
        if drop:
            base = F.linear(xd, weight.detach())
        else:
            base = y if bias is None else y - bias
        return y + ((scale - 1) * base + scale * lora * self.scaling).to(y.dtype)

    def extra_repr(self) -> str:
        out, inp = self.lora_B.shape[0], self.lora_A.shape[1]
        return (f"in={inp}, out={out}, r={self.r}, alpha={self.alpha:g}, scaling={self.scaling:g}"
                f"{', dropout=' + str(self.dropout_p) if self.dropout_p else ''}{', dora' if self.dora else ''}")


class _Int8InputGrad(torch.autograd.Function):
    """An INT8 Linear's output (its own kernel) with the input gradient of its fake-quant twin:
    grad·W_dq inside the activation clip range, 0 outside (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, mod):
        with torch.no_grad():
            y = mod(x)
        ctx.mod = mod
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        mod = ctx.mod
        step, alpha = mod._scalars()
        clip = min(qmax_for(mod.act_bits) * step, alpha) if mod.static_act else alpha
        gx = (grad.float() @ mod.dequantized_weight()).to(x.dtype)
        if math.isfinite(clip):
            gx = gx * (x.abs() <= max(clip, EPS))
        return gx, None


def base_forward(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`base(x)`, with an input gradient for INT8 layers (whose kernels have none)."""
    if isinstance(base, Int8Linear) and torch.is_grad_enabled() and x.requires_grad:
        return _Int8InputGrad.apply(x, base)
    return base(x)


def apply_pairs(pairs: nn.ModuleDict, head_dim: int | None, x: torch.Tensor, y: torch.Tensor,
                weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """y (a base Linear's output over inputs x) plus the updates `pairs` ({full} or q/k/v
    slices of a fused QKV with `head_dim`); `weight`: the base's effective weight (DoRA only)."""
    if FULL in pairs:
        return pairs[FULL](x, y, weight, bias)
    lead = y.shape[:-1]
    parts = list(y.reshape(*lead, -1, 3, head_dim).unbind(-2))  # [.., heads, hd] per slice
    for name, pair in pairs.items():
        j = QKV_SLICES.index(name)
        part = parts[j].reshape(*lead, -1)
        new = pair(x, part, None if weight is None else slice_rows(weight, head_dim, name),
                   None if bias is None else slice_rows(bias, head_dim, name))
        parts[j] = new.reshape(parts[j].shape)
    return torch.stack(parts, dim=-2).reshape(y.shape)


class WrappedLinear(nn.Module):
    """A module around a Linear `base` that reads as that Linear's shape (what swaps, exports
    and shape checks ask of a block Linear)."""

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features


class LoraLinear(WrappedLinear):
    """A block Linear (`base`) plus LoRA/DoRA pairs: `full`, or `q`/`k`/`v` slices of a fused QKV."""

    def __init__(self, base: nn.Module, head_dim: int | None = None):
        super().__init__()
        self.base = base
        self.head_dim = head_dim  # set for the fused QKV projection (slices by head)
        self.adapters = nn.ModuleDict()
        # Saved with the weights: a merged layer reloaded from a checkpoint is not merged again.
        self.register_buffer("lora_merged", torch.zeros((), dtype=torch.bool, device=base.weight.device))

    @property
    def merged(self) -> bool:
        return bool(self.lora_merged)

    @merged.setter
    def merged(self, value: bool) -> None:
        self.lora_merged.fill_(bool(value))

    def train(self, mode: bool = True) -> LoraLinear:
        """The adapters follow `mode`; the frozen base stays in eval mode (a fake-quant base
        keeps its activation scales instead of updating them as in QAT)."""
        super().train(mode)
        self.base.train(False)
        return self

    def slice_rows(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """The rows of slice `name` from a [out, ...] tensor of this layer (all rows for `full`)."""
        return slice_rows(t, self.head_dim, name)

    def add(self, name: str, pair: LoraPair) -> None:
        if name != FULL and self.head_dim is None:
            raise ValueError(f"slice {name!r} needs the fused QKV projection")
        self.adapters[name] = pair

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = base_forward(self.base, x)
        if self.merged or not len(self.adapters):
            return y
        w = effective_weight(self.base) if any(p.dora for p in self.adapters.values()) else None
        return apply_pairs(self.adapters, self.head_dim, x, y, w, getattr(self.base, "bias", None))

    def set_rows(self, t: torch.Tensor, name: str, rows: torch.Tensor) -> None:
        """Write slice `name`'s rows of a [out, ...] tensor in place (inverse of `slice_rows`)."""
        if name == FULL:
            t.copy_(rows)
            return
        view = t.view(-1, 3, self.head_dim, *t.shape[1:])[:, QKV_SLICES.index(name)]
        view.copy_(rows.reshape(view.shape))

    @torch.no_grad()
    def merged_weight(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The float weight [out, in] that computes base + adapters (DoRA: rows rescaled by m/n),
        from `weight` (default: the weight the base multiplies with)."""
        w = (effective_weight(self.base) if weight is None else weight).detach().float().clone()
        for name, pair in self.adapters.items():
            rows = self.slice_rows(w, name)
            new = rows + pair.delta_weight()
            if pair.dora:
                new = new * (pair.magnitude / pair.row_norm(rows))[:, None]
            self.set_rows(w, name, new)
        return w

    def extra_repr(self) -> str:
        return "merged" if self.merged else ""


class LoraHead(nn.Module):
    """The tied word embedding (`base`: plain, fake-quant or INT8) with a LoRA/DoRA pair on the
    vocabulary projection only; lookups are the base's."""

    def __init__(self, base: nn.Module, pair: LoraPair):
        super().__init__()
        self.base = base
        self.pair = pair

    @property
    def weight(self) -> torch.Tensor:  # dtype / device / shape of the tied weight (GPT.new_cache)
        return self.base.weight

    @property
    def num_embeddings(self) -> int:
        return self.base.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.base.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base(ids)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        proj = getattr(self.base, "project", None)
        y = proj(hidden) if proj is not None else F.linear(hidden, self.base.weight)
        w = effective_weight(self.base) if self.pair.dora else None
        return self.pair(hidden.to(y.dtype), y, w, None)
