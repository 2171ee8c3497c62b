"""Mixture-of-Experts FFN: the reference's pretrain_moe layer (docs/moe.md), in plain PyTorch.

A `MoEFFN` takes the place of a block's dense FFN (`linear2(gelu(linear1(x)))`). A gate
routes every token to `topk` of `num_experts` FFNs of the dense shape:

- `switch` (top-1): the token's output is p(e)·FFN_e(x) with p the gate softmax.
- `gshard` (top-2): the best expert and a second one chosen with Gumbel noise in training
  (the best other one in eval); the two probabilities are renormalised to sum to 1.
- `naive`: the top-k logits' softmax weights, no capacity, no balancing loss.

An expert takes at most `capacity = max(ceil(tokens·k/E·factor), min_capacity)` assignments;
with token dropping the later tokens (in token order, first choices before second choices) go
unprocessed: their FFN output is 0 and the block's residual carries them. The balancing loss
is E·Σ_e mean_t(p_e)·frac_t(top-1 = e) (1 when balanced), read by the trainer from `aux_loss`.

Expert weights are stacked ([E, in, out]) so that all experts run as one grouped GEMM
(`torch._grouped_mm`) where torch has it for the shapes, else as a loop over experts. Expert
parallelism (train/parallel_ep.py) replaces `dispatch` from outside; nothing here knows about it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gptforge.config.schema import ModelConfig


def layer_experts(cfg: ModelConfig) -> list[int]:
    """Experts per layer (0 = dense FFN), placed as the reference does: layer i (0-based) is MoE
    when (i + 1) % expert_interval == 0, and no layer is when every count is 1."""
    counts = list(cfg.num_experts or [1])
    if max(counts) <= 1:
        return [0] * cfg.num_layers
    moe = [i for i in range(cfg.num_layers) if (i + 1) % cfg.expert_interval == 0]
    counts = counts * len(moe) if len(counts) == 1 else counts
    out = [0] * cfg.num_layers
    for i, n in zip(moe, counts, strict=False):
        out[i] = n
    return out


@dataclass
class Routing:
    """Kept (token, expert, weight) assignments of one forward, sorted by expert."""
    token: torch.Tensor  # [A] token row of each assignment
    weight: torch.Tensor  # [A] combine weight (fp32)
    counts: list[int]  # assignments per expert (sum = A)


def capacity(tokens: int, experts: int, k: int, factor: float, min_capacity: int) -> int:
    return max(math.ceil(tokens * k / experts * factor), min_capacity)


class ExpertFFNs(nn.Module):
    """E dense FFNs stacked: linear1 [E, hidden, ffn] + bias, GELU(tanh), linear2 [E, ffn, hidden] + bias."""

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        self.linear1_weight = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.linear1_bias = nn.Parameter(torch.zeros(experts, ffn))
        self.linear2_weight = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.linear2_bias = nn.Parameter(torch.zeros(experts, hidden))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of `x` grouped by expert (`counts[e]` rows for expert e, in order) → FFN outputs."""
        return expert_ffn(x, counts, self.linear1_weight, self.linear1_bias, self.linear2_weight, self.linear2_bias)


def expert_ffn(x: torch.Tensor, counts: list[int], w1, b1, w2, b2) -> torch.Tensor:
    """GELU(tanh) FFN of stacked experts over rows grouped by expert."""
    h = grouped_linear(x, w1, b1, counts)
    return grouped_linear(F.gelu(h, approximate="tanh"), w2, b2, counts)


GROUPED_MM = hasattr(torch, "_grouped_mm")  # tests switch it off to compare with the loop


def _grouped_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    # The kernel wants 16-byte aligned rows; it runs on CPU from torch 2.8 and CUDA sm90+.
    if not GROUPED_MM or x.dtype not in (torch.float32, torch.bfloat16) or x.dtype != w.dtype:
        return False
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and w.shape[-1] % align == 0 and (x.device.type == "cpu"
                                                                      or torch.cuda.get_device_capability(x.device)[0] >= 9)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e] + b[e], rows grouped by expert."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[-1])
    if _grouped_ok(x, w):
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        bias = torch.repeat_interleave(b, torch.tensor(counts, device=x.device), dim=0,
                                       output_size=x.shape[0])
        return torch._grouped_mm(x.contiguous(), w, offs=offs) + bias
    parts = [torch.addmm(b[e], xe, w[e]) for e, xe in enumerate(x.split(counts)) if counts[e]]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


class MoEFFN(nn.Module):
    """Gate + experts in place of a dense FFN; see the module docstring for the routing."""

    def __init__(self, hidden: int, ffn: int, experts: int, cfg: ModelConfig):
        super().__init__()
        self.num_experts = experts
        self.gate_type = cfg.moe_gate or ("gshard" if cfg.topk == 2 else "switch")
        self.k = cfg.topk
        self.train_factor = cfg.moe_train_capacity_factor
        self.eval_factor = cfg.moe_eval_capacity_factor
        self.min_capacity = cfg.moe_min_capacity
        self.drop_tokens = cfg.moe_token_dropping
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = ExpertFFNs(experts, hidden, ffn)
        if cfg.moe_use_residual:
            self.linear1 = nn.Linear(hidden, ffn)
            self.linear2 = nn.Linear(ffn, hidden)
            self.coefficient = nn.Linear(hidden, 2)
        self.use_residual = cfg.moe_use_residual
        # Set by every forward (read by the trainer and the log): the balancing loss with its
        # graph, and detached assignments per expert before dropping / dropped assignments.
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.route(flat)
        y = self.dispatch(flat, routing)
        if self.use_residual:
            dense = self.linear2(F.gelu(self.linear1(flat), approximate="tanh"))
            coef = torch.softmax(self.coefficient(flat), dim=-1)
            y = y * coef[:, :1] + dense * coef[:, 1:]
        return y.reshape(shape)

    def dispatch(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Run each kept assignment through its expert and sum them per token, weighted."""
        ys = self.experts(flat[routing.token], routing.counts)
        return combine(flat, ys, routing)

    # ------------------------------------------------------------------ gates

    def route(self, x: torch.Tensor) -> Routing:
        """Gate the rows of x [N, hidden]: kept assignments sorted by expert; sets the statistics."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        probs = torch.softmax(logits, dim=-1)
        N, E = probs.shape
        if self.gate_type == "naive":
            top_val, top_idx = logits.topk(self.k, dim=-1)
            experts = top_idx.t().reshape(-1)  # choice-major: all first choices, then second ...
            weights = torch.softmax(top_val, dim=-1).t().reshape(-1)
            keep = torch.ones_like(experts, dtype=torch.bool)
            self.aux_loss = None
        else:
            first = probs.argmax(dim=-1)
            choices = [first]
            if self.k == 2:
                second_logits = logits
                if self.training:  # GShard: sample the second expert (Gumbel-max)
                    u = torch.rand_like(logits).clamp_(1e-20, 1.0)
                    second_logits = logits - torch.log(-torch.log(u))
                choices.append(second_logits.masked_fill(F.one_hot(first, E).bool(), float("-inf")).argmax(dim=-1))
            experts = torch.cat(choices)
            # E·Σ_e mean(p_e)·frac(first choice = e): minimised by a uniform top-1 load.
            frac = torch.bincount(first, minlength=E).float() / max(N, 1)
            self.aux_loss = (probs.mean(dim=0) * frac).sum() * E
            onehot = F.one_hot(experts, E)
            # Position of each assignment in its expert's queue: token order, first choices first.
            position = (onehot.cumsum(dim=0) - 1).gather(1, experts.unsqueeze(1)).squeeze(1)
            cap = self.capacity(N)
            keep = position < cap if cap is not None else torch.ones_like(experts, dtype=torch.bool)
            weights = probs.gather(1, experts.view(-1, N).t()).t().reshape(-1)
            if self.k == 2:
                w = (weights * keep).view(2, N)
                weights = (w / w.sum(dim=0, keepdim=True).clamp_min(torch.finfo(w.dtype).eps)).reshape(-1)
        tokens = torch.arange(N, device=x.device).repeat(self.k)
        self.tokens_per_expert = torch.bincount(experts, minlength=E).detach()
        self.dropped = (~keep).sum().detach()
        experts, tokens, weights = experts[keep], tokens[keep], weights[keep]
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=E).tolist()
        return Routing(token=tokens[order], weight=weights[order], counts=counts)

    def capacity(self, tokens: int) -> int | None:
        """Assignments an expert may take for `tokens` tokens (None: no limit)."""
        if not self.drop_tokens:
            return None
        factor = self.train_factor if self.training else self.eval_factor
        return capacity(tokens, self.num_experts, self.k, factor, self.min_capacity)


def combine(flat: torch.Tensor, ys: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Σ over a token's kept assignments of weight · expert output ([N, hidden], `flat`'s dtype;
    under autocast the experts may answer in a lower precision)."""
    ys = ys * routing.weight.to(ys.dtype).unsqueeze(1)
    return torch.zeros_like(flat).index_add_(0, routing.token, ys.to(flat.dtype))


def moe_layers(model: nn.Module) -> list[MoEFFN]:
    """The MoE FFNs of a model (through any wrapper), in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEFFN)]


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Mean balancing loss of the last forward over the MoE layers that have one (reference:
    the mean over layers, times Model.balance_loss_weight in the trainer); None without any."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack([v.float() for v in losses]).mean() if losses else None


def load_stats(model: nn.Module) -> dict | None:
    """Routing statistics of the last forward: assignments per expert (per layer), dropped
    assignments and the mean balancing loss; None for a dense model."""
    layers = moe_layers(model)
    if not layers or layers[0].tokens_per_expert is None:
        return None
    aux = aux_loss(model)
    return {"tokens_per_expert": [m.tokens_per_expert.tolist() for m in layers],
            "dropped": int(sum(int(m.dropped) for m in layers)),
            "aux_loss": float(aux.detach()) if aux is not None else None}


@torch.no_grad()
def init_moe_(moe: MoEFFN, std: float, out_std: float) -> None:
    """Every expert drawn like a dense FFN (N(0, std), linear2 N(0, out_std), zero biases); the gate N(0, std)."""
    nn.init.normal_(moe.gate.weight, 0.0, std)
    nn.init.normal_(moe.experts.linear1_weight, 0.0, std)
    nn.init.normal_(moe.experts.linear2_weight, 0.0, out_std)
    nn.init.zeros_(moe.experts.linear1_bias)
    nn.init.zeros_(moe.experts.linear2_bias)
    if moe.use_residual:
        for lin, s in ((moe.linear1, std), (moe.linear2, out_std), (moe.coefficient, std)):
            nn.init.normal_(lin.weight, 0.0, s)
            nn.init.zeros_(lin.bias)
