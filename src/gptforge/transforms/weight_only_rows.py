"""The tied embedding / LM head with its rows at two bit-widths (a mixed-precision plan's head).

A GPT's tied head is a large share of its weights (31% of GPT-2 124M's) and carries most of the
cost of 4-bit weights, but that cost is concentrated in few rows: a row's rounding error moves
only its own token's logit and only its own token's input embedding, so the rows of tokens the
model predicts or reads often matter and the rest hardly do. `MixedRowsEmbedding` keeps the
rows a plan chose (`WeightOnlySpec.head_rows8`) in an 8-bit weight-only table and the others in
a 4-bit one; both tables are ordinary weight-only layers on the usual kernels.

Storage: `wte.hot.*` (the 8-bit rows, in ascending token order) and `wte.cold.*` (every other
row, ascending) in model.safetensors; which rows are hot is named in weight_only.json, so the
file's tensors are only weights and scales. This module does not import the weight-only layers
(it takes them built), so `weight_only` can build it without an import circle.
"""

from __future__ import annotations

import torch
from torch import nn


def row_slots(rows8: torch.Tensor, vocab: int) -> torch.Tensor:
    """slot [vocab] (int64): row v's index in the hot table (v in `rows8`) or, after the hot
    table's rows, in the cold one."""
    hot = torch.zeros(vocab, dtype=torch.bool, device=rows8.device)
    hot[rows8] = True
    order = torch.cat([rows8.long(), (~hot).nonzero().squeeze(1)])
    slot = torch.empty(vocab, dtype=torch.long, device=rows8.device)
    slot[order] = torch.arange(vocab, device=rows8.device)
    return slot


class MixedRowsEmbedding(nn.Module):
    """Lookup and head product of a tied embedding whose rows `rows8` live in `hot` and the rest
    in `cold` (weight-only embeddings with `forward(ids)` and `matmul(x)`). The outputs are what a
    float embedding holding each row's dequantized value computes."""

    def __init__(self, hot: nn.Module, cold: nn.Module, rows8: torch.Tensor):
        super().__init__()
        self.hot, self.cold = hot, cold
        self.num_embeddings = hot.num_embeddings + cold.num_embeddings
        self.embedding_dim = hot.embedding_dim
        self.register_buffer("slot", row_slots(rows8, self.num_embeddings), persistent=False)
        self._n_hot = int(hot.num_embeddings)

    @property
    def weight(self) -> torch.Tensor:
        """The row map [vocab] (int64, not a weight): what callers read `wte.weight` for is its
        first dimension (the vocabulary), its device and that it is not floating (activations
        then take the position embedding's dtype), as with the other quantized embeddings."""
        return self.slot

    @property
    def rows8(self) -> torch.Tensor:
        """The token ids of the 8-bit rows, ascending."""
        return (self.slot < self._n_hot).nonzero().squeeze(1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        slot = self.slot[ids]
        if ids.numel() == 1:  # a decode step: one table's lookup (each costs ~0.1 ms of small ops)
            s = int(slot.reshape(()))
            return self.hot(slot) if s < self._n_hot else self.cold(slot - self._n_hot)
        hot = slot < self._n_hot
        # both lookups read one row per id (a few KB at decode); `where` picks each id's own table
        a = self.hot(slot.clamp(max=self._n_hot - 1))
        b = self.cold((slot - self._n_hot).clamp(min=0))
        return torch.where(hot.unsqueeze(-1), a, b)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: logits [..., vocab] in token order."""
        y = torch.cat([self.hot.matmul(hidden), self.cold.matmul(hidden)], dim=-1)
        return y.index_select(-1, self.slot)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float [vocab, dim] weight the layer computes with."""
        w = torch.cat([self.hot.dequantized_weight(dtype), self.cold.dequantized_weight(dtype)])
        return w.index_select(0, self.slot)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {self._n_hot} rows at {self.hot.bits} bits, "
                f"{self.num_embeddings - self._n_hot} at {self.cold.bits}")
