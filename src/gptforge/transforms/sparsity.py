"""2:4 semi-structured sparsity of the block Linears, kept through fine-tuning.

`Compress.Prune.semi_structured`:
- `magnitude`: in every group of 4 consecutive input weights of each output row, keep the 2
  with the largest |W|;
- `wanda`: the same groups scored by |W_ij|·‖X_j‖₂, where ‖X_j‖₂ is the L2 norm of input
  feature j over calibration tokens (Sun et al., "Wanda"); the activation-aware choice
  usually loses less.

The layers are every block's qkv_proj, out_proj, linear1 and linear2 (not the embeddings or
the tied head). `SparsityKeeper` keeps the pattern during fine-tuning without touching the
model's structure or parameter names: a gradient hook zeroes the masked gradient entries and
an optimizer step post-hook re-applies the mask after each update (so weight decay, momentum
or a loss-scaler step can never revive a pruned weight). Saved weights are therefore exactly
2:4 sparse, and a resumed run re-derives the masks from the saved zeros.

Speed: dense kernels do the same work on a 2:4 matrix. On CUDA (Ampere+) `to_semi_structured`
converts the layers with `torch.sparse.to_sparse_semi_structured` (cuSPARSELt / CUTLASS) for
inference; on CPU there is no 2:4 kernel and no speed-up.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from gptforge.errors import ConfigError, UsageError
from gptforge.model.gpt import block_linears

METHODS = ("magnitude", "wanda")
N, M = 2, 4  # keep N of every M


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"Compress.Prune.semi_structured: {method!r} is not one of {', '.join(METHODS)} "
                          "(leave it blank for no 2:4 sparsity)")


def target_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """{qualified name: Linear} of the layers that become 2:4 sparse."""
    out = dict(block_linears(model))
    for name, mod in out.items():
        if mod.weight.shape[1] % M:
            raise ConfigError(f"Compress.Prune.semi_structured: {name} has {mod.weight.shape[1]} "
                              f"inputs, not a multiple of {M}; 2:4 sparsity needs groups of {M} inputs")
    return out


def mask_2_4(score: torch.Tensor) -> torch.Tensor:
    """Boolean mask keeping the 2 highest scores of every 4 consecutive entries along dim 1."""
    rows, cols = score.shape
    groups = score.float().reshape(rows, cols // M, M)
    keep = groups.topk(N, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(rows, cols)


def is_2_4(weight: torch.Tensor) -> bool:
    """True when every group of 4 consecutive inputs of each row has at most 2 non-zeros."""
    rows, cols = weight.shape
    if cols % M:
        return False
    return bool(((weight.reshape(rows, cols // M, M) != 0).sum(-1) <= N).all())


@torch.no_grad()
def input_norms(model: nn.Module, layers: dict[str, nn.Linear], batches: Iterable[dict]) -> dict[str, torch.Tensor]:
    """‖X_j‖₂ over all calibration tokens for every input feature j of each layer."""
    sums: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(module, args):
            x = args[0].detach().float()
            sq = x.reshape(-1, x.shape[-1]).pow(2).sum(0)
            sums[name] = sq if name not in sums else sums[name] + sq
        return fn

    handles = [mod.register_forward_pre_hook(hook(name)) for name, mod in layers.items()]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            model(batch["tokens"].to(device), position_ids=batch["position_ids"].to(device)
                  if "position_ids" in batch else None)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if len(sums) != len(layers):
        raise ConfigError("Compress.Prune.semi_structured wanda: no calibration batch was seen; "
                          "set Compress.Prune.calib_batches >= 1 and give Train data")
    return {k: v.sqrt() for k, v in sums.items()}


def compute_masks(model: nn.Module, method: str, batches: Iterable[dict] | None = None) -> dict[str, torch.Tensor]:
    """{layer name: bool mask} choosing 2 of every 4 weights by `method`."""
    check_method(method)
    layers = target_layers(model)
    norms = None
    if method == "wanda":
        if batches is None:
            raise ConfigError("Compress.Prune.semi_structured wanda: needs calibration batches (Train data)")
        norms = input_norms(model, layers, batches)
    masks = {}
    for name, mod in layers.items():
        score = mod.weight.detach().float().abs()
        if norms is not None:
            score = score * norms[name].to(score.device)[None, :]
        masks[name] = mask_2_4(score)
    return masks


def masks_from_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Masks of an already 2:4-sparse model (a resumed run): the kept weights are the largest."""
    layers = target_layers(model)
    for name, mod in layers.items():
        if not is_2_4(mod.weight.detach()):
            raise UsageError(f"{name}: the weights are not 2:4 sparse, so there is no pattern to keep")
    return {name: mask_2_4(mod.weight.detach().abs()) for name, mod in layers.items()}


class SparsityKeeper:
    """Applies 2:4 masks and keeps them through training (see the module docstring)."""

    def __init__(self, model: nn.Module, masks: dict[str, torch.Tensor]):
        layers = target_layers(model)
        missing = sorted(set(masks) - set(layers))
        if missing:
            raise UsageError(f"2:4 masks name layers the model lacks: {', '.join(missing[:3])}")
        self.params = {name: layers[name].weight for name in masks}
        self.masks = {name: m.to(self.params[name].device) for name, m in masks.items()}
        self._handles: list = []

    @torch.no_grad()
    def apply(self) -> None:
        """Zero every masked weight."""
        for name, p in self.params.items():
            p.mul_(self.masks[name].to(p.dtype))

    def attach(self, optimizer: torch.optim.Optimizer | None = None) -> SparsityKeeper:
        """Mask gradients, and re-apply the masks after every step of `optimizer`."""
        self.detach()
        for name, p in self.params.items():
            mask = self.masks[name]
            self._handles.append(p.register_hook(lambda g, m=mask: g * m.to(g.dtype)))
        if optimizer is not None:
            owned = {id(q) for g in optimizer.param_groups for q in g["params"]}
            lost = [n for n, p in self.params.items() if p.requires_grad and id(p) not in owned]
            if lost:
                raise UsageError(f"2:4 sparsity: the optimizer does not hold {lost[0]}.weight; apply the "
                                 "masks to the model the optimizer trains")
            self._handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self.apply()))
        self.apply()
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def check(self) -> None:
        """Raise if any layer lost its 2:4 pattern."""
        for name, p in self.params.items():
            if not is_2_4(p.detach()):
                raise UsageError(f"{name}: weights are no longer 2:4 sparse")

    def sparsity(self) -> float:
        """Fraction of zero weights over the masked layers."""
        zeros = sum(int((p == 0).sum()) for p in self.params.values())
        return zeros / max(1, sum(p.numel() for p in self.params.values()))


def to_semi_structured(model: nn.Module) -> nn.Module:
    """Store the 2:4 layers as `torch.sparse` semi-structured tensors for fast CUDA inference.

    Needs a CUDA GPU with sparse tensor cores (compute capability >= 8.0) and fp16/bf16
    weights; inference only (the weights become non-trainable sparse tensors).
    """
    from torch.sparse import to_sparse_semi_structured

    if not torch.cuda.is_available():
        raise UsageError("2:4 sparse kernels need a CUDA GPU; on CPU the dense weights are already the fastest path")
    for name, mod in target_layers(model).items():
        if not is_2_4(mod.weight.detach()):
            raise UsageError(f"{name}: weights are not 2:4 sparse")
        if mod.weight.device.type != "cuda":
            raise UsageError(f"{name}: move the model to CUDA first")
        mod.weight = nn.Parameter(to_sparse_semi_structured(mod.weight.detach()), requires_grad=False)
    return model
