"""Structured pruning (spec §10): remove whole attention heads and FFN neurons from outside the
model, so that it becomes physically smaller, and record the new shape in its config.

Three steps, each usable on its own:
1. scores (`prune_scores.importance`): one tensor per layer for heads and for neurons;
2. a plan (`make_plan`): which heads / neurons each layer keeps. `uniform` removes
   `min(n-1, round(n·ratio))` in every layer (the reference; stock GPT-2 shapes stay
   exportable); `global` ranks all layers together and keeps at least one head and one neuron
   per layer (per-layer widths);
3. surgery (`apply_plan`): slice the head's 3·head_dim rows of the fused QKV weight and bias
   (our rows are grouped per head, [q_h k_h v_h]) and its head_dim input columns of out_proj;
   a neuron's linear1 row and bias entry and its linear2 input column. Output sizes of
   out_proj / linear2, LayerNorms, embeddings and the hidden size are untouched.

`record_shape` writes the result into a `ModelConfig` (uniform → num_attention_heads, head_dim,
ffn_hidden_size; otherwise → layer_num_heads / layer_ffn_sizes), so a checkpoint saved from
the pruned model loads with `model_io.load_model` without pruning again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from gptforge.errors import ConfigError, UsageError
from gptforge.transforms.prune_scores import CALIBRATED, check_criterion, importance

SCOPES = ("uniform", "global")


@dataclass
class PrunePlan:
    """Kept head / neuron indices (ascending) of every layer, and the sizes before pruning."""

    heads: list[list[int]]
    ffn: list[list[int]]
    orig_heads: list[int]
    orig_ffn: list[int]

    @property
    def layer_heads(self) -> list[int]:
        return [len(k) for k in self.heads]

    @property
    def layer_ffn(self) -> list[int]:
        return [len(k) for k in self.ffn]

    def removed_heads(self) -> list[list[int]]:
        return [sorted(set(range(n)) - set(k)) for n, k in zip(self.orig_heads, self.heads, strict=True)]

    def summary(self) -> str:
        def span(before: list[int], after: list[int]) -> str:
            if len(set(before)) == 1 and len(set(after)) == 1:
                return f"{after[0]} of {before[0]} per layer"
            return f"{sum(after)} of {sum(before)} (per layer {after})"
        return f"heads {span(self.orig_heads, self.layer_heads)}, FFN neurons {span(self.orig_ffn, self.layer_ffn)}"


@dataclass
class PruneReport:
    """What `prune_model` did: the plan, parameter counts and the criterion."""

    plan: PrunePlan
    criterion: str
    params_before: int
    params_after: int
    scores: dict = field(default_factory=dict, repr=False)


def num_pruned(n: int, ratio: float) -> int:
    """The reference's `pruned_num = min(len-1, round(len·ratio))` (Python rounding)."""
    return min(n - 1, int(round(n * ratio))) if n > 0 else 0


def check_ratio(name: str, ratio: float) -> None:
    if not 0.0 <= ratio < 1.0:
        raise ConfigError(f"Compress.Prune.{name}: must be in [0, 1), got {ratio}")


def _select_uniform(scores: list[torch.Tensor], ratio: float) -> list[list[int]]:
    kept = []
    for s in scores:
        drop = num_pruned(len(s), ratio)
        order = torch.sort(s.float(), stable=True).indices  # lowest score first, ties by index
        kept.append(sorted(order[drop:].tolist()))
    return kept


def _select_global(scores: list[torch.Tensor], ratio: float) -> list[list[int]]:
    sizes = [len(s) for s in scores]
    total = sum(sizes)
    drop = min(total - len(sizes), int(round(total * ratio)))
    flat = torch.cat([s.float() for s in scores])
    layer_of = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    index_of = torch.cat([torch.arange(n) for n in sizes])
    remaining = list(sizes)
    removed: list[set[int]] = [set() for _ in sizes]
    for j in torch.sort(flat, stable=True).indices.tolist():
        if drop == 0:
            break
        layer = int(layer_of[j])
        if remaining[layer] > 1:  # every layer keeps at least one
            removed[layer].add(int(index_of[j]))
            remaining[layer] -= 1
            drop -= 1
    return [sorted(set(range(n)) - r) for n, r in zip(sizes, removed, strict=True)]


def make_plan(head_scores: list[torch.Tensor], ffn_scores: list[torch.Tensor], head_ratio: float,
              ffn_ratio: float, scope: str = "uniform") -> PrunePlan:
    """Which heads / neurons each layer keeps: the lowest-scored are removed."""
    check_ratio("head_ratio", head_ratio)
    check_ratio("ffn_ratio", ffn_ratio)
    if scope not in SCOPES:
        raise ConfigError(f"Compress.Prune.scope: {scope!r} is not one of {', '.join(SCOPES)}")
    select = _select_uniform if scope == "uniform" else _select_global
    return PrunePlan(heads=select(head_scores, head_ratio), ffn=select(ffn_scores, ffn_ratio),
                     orig_heads=[len(s) for s in head_scores], orig_ffn=[len(s) for s in ffn_scores])


# ------------------------------------------------------------------------------ surgery


def narrow_linear(lin: nn.Linear, out_index: torch.Tensor | None = None,
                  in_index: torch.Tensor | None = None) -> nn.Linear:
    """A new nn.Linear holding the selected output rows / input columns of `lin` (and bias)."""
    if type(lin) is not nn.Linear:
        raise UsageError(f"pruning expects plain nn.Linear layers, found {type(lin).__name__}; "
                         "prune before quantizing (prune, then QAT), not after")
    w, b = lin.weight.detach(), lin.bias.detach() if lin.bias is not None else None
    if out_index is not None:
        w = w.index_select(0, out_index.to(w.device))
        b = b.index_select(0, out_index.to(w.device)) if b is not None else None
    if in_index is not None:
        w = w.index_select(1, in_index.to(w.device))
    with torch.device("meta"):  # no wasted init: the parameters are replaced right away
        new = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    new.weight = nn.Parameter(w.clone(), requires_grad=lin.weight.requires_grad)
    if b is not None:
        new.bias = nn.Parameter(b.clone(), requires_grad=lin.bias.requires_grad)
    new.train(lin.training)
    return new


def _block_index(kept: list[int], width: int) -> torch.Tensor:
    k = torch.tensor(kept, dtype=torch.long)
    return (k[:, None] * width + torch.arange(width)[None, :]).reshape(-1)


def layer_shapes_of(model: nn.Module) -> tuple[list[int], list[int]]:
    """Per-layer (heads, FFN width) read from the weights actually present."""
    heads = [blk.attn.qkv_proj.out_features // (3 * blk.attn.head_dim) for blk in model.blocks]
    ffn = [blk.linear1.out_features for blk in model.blocks]
    return heads, ffn


@torch.no_grad()
def apply_plan(model: nn.Module, plan: PrunePlan) -> nn.Module:
    """Physically remove the heads / neurons the plan drops (in place; returns `model`)."""
    heads, ffn = layer_shapes_of(model)
    if heads != plan.orig_heads or ffn != plan.orig_ffn:
        raise UsageError(f"the prune plan was made for heads {plan.orig_heads} / FFN {plan.orig_ffn}, "
                         f"the model has {heads} / {ffn}")
    for blk, kh, kf, nh, nf in zip(model.blocks, plan.heads, plan.ffn, heads, ffn, strict=True):
        if len(kh) < nh:
            hd = blk.attn.head_dim
            blk.attn.qkv_proj = narrow_linear(blk.attn.qkv_proj, out_index=_block_index(kh, 3 * hd))
            blk.attn.out_proj = narrow_linear(blk.attn.out_proj, in_index=_block_index(kh, hd))
        if len(kf) < nf:
            idx = torch.tensor(kf, dtype=torch.long)
            blk.linear1 = narrow_linear(blk.linear1, out_index=idx)
            blk.linear2 = narrow_linear(blk.linear2, in_index=idx)
    if getattr(model, "config", None) is not None:
        record_shape(model.config, model)
    return model


def record_shape(model_cfg, model: nn.Module) -> None:
    """Write the model's actual per-layer shape into `model_cfg` (a ModelConfig, in place).

    Uniform layers set num_attention_heads / head_dim / ffn_hidden_size (what HF GPT-2 can
    express); otherwise layer_num_heads / layer_ffn_sizes list every layer.
    """
    heads, ffn = layer_shapes_of(model)
    model_cfg.head_dim = model.blocks[0].attn.head_dim  # explicit: heads·head_dim may now differ from hidden
    if len(set(heads)) == 1:
        model_cfg.num_attention_heads, model_cfg.layer_num_heads = heads[0], None
    else:
        model_cfg.layer_num_heads = heads
    if len(set(ffn)) == 1:
        model_cfg.ffn_hidden_size, model_cfg.layer_ffn_sizes = ffn[0], None
    else:
        model_cfg.layer_ffn_sizes = ffn


def prune_model(model: nn.Module, pcfg, batches: Iterable[dict] | None = None,
                keep_scores: bool = False) -> PruneReport:
    """Score, plan and cut `model` in place following `Compress.Prune` (a PruneConfig).

    `batches` (calibration data) are needed by the `taylor` and `activation` criteria.
    The model's own `config` is updated; copy it into the run config with `record_shape`.
    """
    from gptforge.transforms.quant import refuse_moe

    refuse_moe(model, "structured pruning")
    check_criterion(pcfg.criterion)
    head_ratio = pcfg.ratio if pcfg.head_ratio is None else pcfg.head_ratio
    ffn_ratio = pcfg.ratio if pcfg.ffn_ratio is None else pcfg.ffn_ratio
    before = sum(p.numel() for p in model.parameters())
    if pcfg.criterion in CALIBRATED and batches is not None:
        batches = list(batches)
    head_scores, ffn_scores = importance(model, pcfg.criterion, batches)
    plan = make_plan(head_scores, ffn_scores, head_ratio, ffn_ratio, pcfg.scope)
    apply_plan(model, plan)
    after = sum(p.numel() for p in model.parameters())
    scores = {"heads": head_scores, "ffn": ffn_scores} if keep_scores else {}
    return PruneReport(plan=plan, criterion=pcfg.criterion, params_before=before, params_after=after,
                       scores=scores)
