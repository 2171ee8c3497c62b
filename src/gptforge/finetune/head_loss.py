"""The token loss of a GPT whose vocabulary projection is frozen (LoRA without a head adapter),
without keeping [N, V] logits or softmax for backward.

`lm_loss` keeps softmax − onehot [N, V] in fp32 for its backward (206 MB for 4 × 256 tokens
of GPT-2's vocabulary), next to the logits it was computed from. When the head weight W
[V, h] takes no gradient, the only gradient the loss passes back is the one of the hidden
states, (softmax − onehot)·weight·W: linear in the incoming scalar gradient, so it is formed
in the forward, a chunk of rows at a time, and only it [N, h] is kept. The same matmuls
run (the head's forward and its input gradient), in another order; the peak drops by the
two [N, V] tensors. Rows that carry no loss (prompt tokens, padding: weight 0) have neither
a loss term nor a gradient, so their logits are not computed at all: in instruction tuning,
where most tokens are prompt, that skips most of the head's two matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gptforge.model.gpt import GPT, softmax_ce, token_weights

CHUNK_ROWS = 256


def frozen_head(model: nn.Module) -> torch.Tensor | None:
    """The tied head weight of a plain GPT whose logits are `hidden @ wteᵀ` and whose `wte`
    takes no gradient; None for anything else (a head adapter, a quantized head, full tuning,
    a model wrapped or hooked for parallel training: the loss calls `hidden_states`, not the
    model's forward, so forward hooks such as FSDP's gathers would not run)."""
    if type(model) is not GPT or model._forward_hooks or model._forward_pre_hooks:
        return None
    if "logits" in vars(model) or type(model.wte) is not nn.Embedding:
        return None
    return None if model.wte.weight.requires_grad else model.wte.weight


class _FrozenHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head, labels, weight):
        grad = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        live = (weight != 0).nonzero().squeeze(1)  # prompt and padding tokens: no loss, no gradient
        for s in range(0, live.numel(), CHUNK_ROWS):
            rows = live[s:s + CHUNK_ROWS]
            w = weight[rows]
            loss, p = softmax_ce(F.linear(hidden[rows], head), labels[rows], w, grad is not None)
            total += loss
            if p is not None:
                grad[rows] = F.linear(p.mul_(w.unsqueeze(1)).to(head.dtype), head.t()).to(hidden.dtype)
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g.to(grad.dtype), None, None, None


def frozen_head_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor,
                     loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`lm_loss(hidden @ headᵀ, labels, loss_mask)` for a frozen `head`, in chunks of rows."""
    labels, weight = token_weights(labels, loss_mask)
    return _FrozenHeadLoss.apply(hidden.reshape(-1, hidden.shape[-1]), head.detach(), labels, weight)
