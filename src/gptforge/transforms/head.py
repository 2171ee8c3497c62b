"""The tied LM head routed through a swapped embedding module.

A fake-quant, INT8 or weight-only embedding computes the head with its own weight numerics
(`project`); `install_head` points the model's `logits` at it. An instance attribute: the model
class stays untouched and the state dict does not change.
"""

from __future__ import annotations

import types

import torch
from torch import nn


def embedding_logits(self, hidden: torch.Tensor) -> torch.Tensor:
    return self.wte.project(hidden)


def install_head(model: nn.Module) -> None:
    """Route the model's `logits` through `model.wte.project`."""
    model.logits = types.MethodType(embedding_logits, model)
