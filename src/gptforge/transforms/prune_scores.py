"""Importance scores of attention heads and FFN neurons: one score tensor per layer.

Criteria (`Compress.Prune.criterion`):
- `l1_norm` (the reference): per head, mean |w| over the head's q, k and v rows of the fused
  QKV weight (all input columns); per FFN neuron, mean |w| of its linear1 row (the reference's
  "column" of the [in, out] Paddle weight). Biases are not scored, as in the reference.
- `l2_norm`: the L2 norm of the same groups.
- `taylor`: the first-order Taylor estimate of the loss change when the group is removed,
  |∂L/∂m| for a mask m multiplying the head's output (or the neuron's activation), taken per
  calibration sequence and summed (Michel et al. 2019; Molchanov et al. 2019). ∂L/∂m equals
  Σ grad·w over the group's out_proj / linear2 input columns, computed here from the
  activations and their gradients.
- `activation`: mean over calibration tokens of ‖head output‖₂ per head and of |GELU output|
  per neuron (Minitron's activation-based importance).

Calibration criteria need batches as the data loader yields them (`tokens`, `position_ids`,
`labels`, `loss_mask`); the model is run in eval mode (no dropout) and its training mode and
gradients are restored afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from gptforge.errors import ConfigError

CRITERIA = ("l1_norm", "l2_norm", "taylor", "activation")
CALIBRATED = ("taylor", "activation")


def check_criterion(criterion: str) -> None:
    if criterion not in CRITERIA:
        raise ConfigError(f"Compress.Prune.criterion: {criterion!r} is not one of {', '.join(CRITERIA)}")


def _blocks(model: nn.Module):
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ConfigError("pruning needs a gptforge GPT model (with .blocks)")
    return blocks


@torch.no_grad()
def weight_scores(model: nn.Module, criterion: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(head scores, neuron scores) per layer from the weights alone (`l1_norm` / `l2_norm`)."""
    heads, ffn = [], []
    for blk in _blocks(model):
        hd = blk.attn.head_dim
        w = blk.attn.qkv_proj.weight.detach().float()
        groups = w.reshape(-1, 3 * hd, w.shape[1])  # one contiguous [q_h k_h v_h] block per head
        w1 = blk.linear1.weight.detach().float()
        if criterion == "l1_norm":
            heads.append(groups.abs().mean(dim=(1, 2)).cpu())
            ffn.append(w1.abs().mean(dim=1).cpu())
        else:
            heads.append(groups.pow(2).sum(dim=(1, 2)).sqrt().cpu())
            ffn.append(w1.norm(dim=1).cpu())
    return heads, ffn


def _forward_loss(model: nn.Module, batch: dict, device: torch.device) -> torch.Tensor:
    b = {k: v.to(device) for k, v in batch.items()}
    return model(b["tokens"], position_ids=b.get("position_ids"), labels=b["labels"],
                 loss_mask=b.get("loss_mask")).loss


def calibration_scores(model: nn.Module, batches: Iterable[dict], criterion: str,
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(head scores, neuron scores) per layer from calibration batches (`taylor` / `activation`).

    The inputs of out_proj (the concatenated head outputs) and of linear2 (the GELU outputs)
    are observed with forward pre-hooks; for `taylor` their gradients too.
    """
    blocks = _blocks(model)
    device = next(model.parameters()).device
    head_acc: list[torch.Tensor | None] = [None] * len(blocks)
    ffn_acc: list[torch.Tensor | None] = [None] * len(blocks)
    tokens = 0

    def add(acc, i, value):
        acc[i] = value if acc[i] is None else acc[i] + value

    def observer(i: int, hd: int | None, acc):
        def grad_hook(x):
            def on_grad(g):
                prod = (g.float() * x.detach().float())
                B, T = prod.shape[:2]
                per_group = prod.reshape(B, T, -1, hd).sum(dim=(1, 3)) if hd else prod.sum(dim=1)
                add(acc, i, per_group.abs().sum(0).cpu())
            return on_grad

        def hook(module, args):
            x = args[0]
            if criterion == "activation":
                xf = x.detach().float()
                mag = xf.reshape(*xf.shape[:-1], -1, hd).norm(dim=-1) if hd else xf.abs()
                add(acc, i, mag.reshape(-1, mag.shape[-1]).sum(0).cpu())
            elif x.requires_grad:
                x.register_hook(grad_hook(x))
        return hook

    handles = []
    for i, blk in enumerate(blocks):
        handles.append(blk.attn.out_proj.register_forward_pre_hook(observer(i, blk.attn.head_dim, head_acc)))
        handles.append(blk.linear2.register_forward_pre_hook(observer(i, None, ffn_acc)))
    was_training = model.training
    model.eval()
    n = 0
    try:
        for batch in batches:
            n += 1
            tokens += int(batch["tokens"].numel())
            if criterion == "taylor":
                with torch.enable_grad():
                    _forward_loss(model, batch, device).backward()
            else:
                with torch.no_grad():
                    _forward_loss(model, batch, device)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        if criterion == "taylor":
            for p in model.parameters():
                p.grad = None
    if n == 0 or any(a is None for a in head_acc + ffn_acc):
        raise ConfigError(f"Compress.Prune.criterion {criterion}: no calibration batch was seen; "
                          "set Compress.Prune.calib_batches >= 1 and give Train data")
    if criterion == "activation":
        return [a / tokens for a in head_acc], [a / tokens for a in ffn_acc]
    return list(head_acc), list(ffn_acc)


def importance(model: nn.Module, criterion: str, batches: Iterable[dict] | None = None,
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer (head scores, neuron scores) for `criterion`; higher = more important."""
    check_criterion(criterion)
    if criterion in CALIBRATED:
        if batches is None:
            raise ConfigError(f"Compress.Prune.criterion {criterion}: needs calibration batches (Train data)")
        return calibration_scores(model, batches, criterion)
    return weight_scores(model, criterion)
