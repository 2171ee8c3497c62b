"""The GPT model of the reference (spec §1), in plain PyTorch, readable top to bottom.

Pre-LN decoder: learned token + position embeddings → L × [x + attn(LN1 x); x + mlp(LN2 x)]
→ final LN → logits = h · W_embᵀ (tied head, no bias). GELU is the tanh approximation,
LayerNorm eps 1e-5, every Linear has a bias.

The fused QKV projection keeps the reference's per-head interleaved output layout
[q_h0, k_h0, v_h0, q_h1, ...]: a contiguous block of rows is one whole head, so a column
split (tensor parallel) or removing a head slices whole heads, and the head count is read from
the tensor shape at run time.

Nothing here knows about distribution, quantization or structural edits: those are applied
from outside by swapping or wrapping the sub-modules. Recompute granularities map onto
modules: `Block` (full), `Block.attn` (full_attn), `Block.attn.core` (core_attn).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gptforge.config.schema import ModelConfig
from gptforge.model.kv_cache import KVCache
from gptforge.model.moe import MoEFFN, init_moe_, layer_experts


@dataclass
class GPTOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class CoreAttention(nn.Module):
    """softmax(q·kᵀ/√d)·v with dropout on the probabilities (the core_attn recompute unit)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, dropout: float, layer_idx: int):
        super().__init__()
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.qkv_proj = nn.Linear(hidden, 3 * heads * head_dim)
        self.out_proj = nn.Linear(heads * head_dim, hidden)
        self.core = CoreAttention(dropout)

    def forward(self, x, mask=None, is_causal=True, cache: KVCache | None = None):
        B, T, _ = x.shape
        # -1 heads: the count comes from the weight actually present (sharded or narrowed).
        qkv = self.qkv_proj(x).view(B, T, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        attend = getattr(cache, "attend", None)
        if attend is not None:  # a cache of per-sequence slots attends each sequence over its own keys
            y = attend(self.layer_idx, q, k, v, self.core)
        else:
            if cache is not None:
                k, v = cache.update(self.layer_idx, k, v)
            y = self.core(q, k, v, mask, is_causal)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, heads: int, ffn: int, layer_idx: int, experts: int = 0):
        super().__init__()
        h = cfg.hidden_size
        self.norm1 = nn.LayerNorm(h, eps=cfg.layer_norm_epsilon)
        self.attn = SelfAttention(h, heads, cfg.head_dim, cfg.attention_probs_dropout_prob, layer_idx)
        self.norm2 = nn.LayerNorm(h, eps=cfg.layer_norm_epsilon)
        # An MoE layer (model/moe.py) has `moe` in place of linear1/linear2.
        self.moe = MoEFFN(h, ffn, experts, cfg) if experts else None
        if self.moe is None:
            self.linear1 = nn.Linear(h, ffn)
            self.act = nn.GELU(approximate="tanh")  # a module: a decode backend may run its own kernel
            self.linear2 = nn.Linear(ffn, h)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x, mask=None, is_causal=True, cache: KVCache | None = None):
        x = x + self.dropout(self.attn(self.norm1(x), mask, is_causal, cache))
        h = self.norm2(x)
        if self.moe is not None:
            return x + self.dropout(self.moe(h))
        # No dropout between GELU and linear2 (spec §1.1).
        return x + self.dropout(self.linear2(self.act(self.linear1(h))))


# A block's Linear layers by their path inside the block, in the reference's counting order
# (`linear_{4i+j}`): what quantization, sparsity, export and tensor parallel walk from outside.
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "linear1", "linear2")


def block_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(`blocks.{i}.{path}`, module) of every block Linear, block by block in BLOCK_LINEARS order
    (an MoE block holds `moe` in place of linear1/linear2: only its attention's two)."""
    for i, blk in enumerate(model.blocks):
        for path in BLOCK_LINEARS if getattr(blk, "moe", None) is None else BLOCK_LINEARS[:2]:
            yield f"blocks.{i}.{path}", blk.get_submodule(path)


def layer_shapes(cfg: ModelConfig) -> tuple[list[int], list[int]]:
    """Per-layer (head counts, FFN widths); uniform unless the config lists them."""
    L = cfg.num_layers
    heads = list(cfg.layer_num_heads) if cfg.layer_num_heads else [cfg.num_attention_heads] * L
    ffn = cfg.ffn_hidden_size or 4 * cfg.hidden_size
    ffns = list(cfg.layer_ffn_sizes) if cfg.layer_ffn_sizes else [ffn] * L
    return heads, ffns


class GPT(nn.Module):
    """GPT language model. `cfg` must be resolved (see `gptforge.config.resolve_model`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.head_dim is None or cfg.ffn_hidden_size is None:
            raise ValueError("ModelConfig is not resolved: call gptforge.config.resolve_model(cfg) first")
        self.config = cfg
        heads, ffns = layer_shapes(cfg)
        experts = layer_experts(cfg)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.hidden_dropout_prob)
        self.blocks = nn.ModuleList(Block(cfg, heads[i], ffns[i], i, experts[i]) for i in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)
        if self.wte.weight.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Reference init: N(0, 0.02) weights, out_proj/linear2 N(0, 0.02/√(2L)), zero biases."""
        std = self.config.initializer_range
        out_std = std / math.sqrt(2 * self.config.num_layers) if self.config.scale_output_init else std
        nn.init.normal_(self.wte.weight, 0.0, std)
        nn.init.normal_(self.wpe.weight, 0.0, std)
        for blk in self.blocks:
            ffn = ((blk.linear1, std), (blk.linear2, out_std)) if blk.moe is None else ()
            if blk.moe is not None:
                init_moe_(blk.moe, std, out_std)
            for lin, s in ((blk.attn.qkv_proj, std), (blk.attn.out_proj, out_std), *ffn):
                nn.init.normal_(lin.weight, 0.0, s)
                nn.init.zeros_(lin.bias)
            for ln in (blk.norm1, blk.norm2):
                nn.init.ones_(ln.weight)
                nn.init.zeros_(ln.bias)
        nn.init.ones_(self.norm.weight)
        nn.init.zeros_(self.norm.bias)

    def new_cache(self, batch_size: int, max_len: int, dtype=None, device=None) -> KVCache:
        """A KV cache for `batch_size` sequences of up to `max_len` positions, stored in `dtype`
        (default: the model's; torch.bfloat16 or torch.int8 compress it, see `model/kv_cache.py`)."""
        heads = [blk.attn.qkv_proj.out_features // (3 * blk.attn.head_dim) for blk in self.blocks]
        w = self.wte.weight
        return KVCache(heads, batch_size, max_len, self.config.head_dim,
                       dtype=dtype or w.dtype, device=device or w.device)

    @staticmethod
    def attention_mask(T: int, start: int, key_mask: torch.Tensor | None, device) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) for T new queries at absolute positions start..start+T-1.

        `key_mask` is [B, start+T] with 1 for real tokens and 0 for padding (left padding in
        batched generation). Each query always sees itself so that padded rows stay finite.
        """
        if key_mask is None:
            if start == 0:
                return None, True
            if T == 1:
                return None, False
            causal = torch.ones(T, start + T, dtype=torch.bool, device=device).tril(diagonal=start)
            return causal, False
        if key_mask.dim() == 4:
            return key_mask, False
        Tk = key_mask.shape[-1]
        if Tk != start + T:
            raise ValueError(f"attention_mask covers {Tk} positions, expected {start + T} (past + new)")
        causal = torch.ones(T, Tk, dtype=torch.bool, device=device).tril(diagonal=start)
        mask = causal[None] & key_mask.bool()[:, None, :]
        mask |= torch.eye(T, Tk, dtype=torch.bool, device=device).roll(start, dims=1)[None]
        return mask[:, None], False

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings (dropout while training): the first block's input [B, T, hidden]."""
        return self.drop(self.wte(input_ids) + self.wpe(position_ids))

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """Final-LayerNorm hidden states [B, T, hidden] (no vocabulary projection)."""
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=input_ids.device).unsqueeze(0)
        x = self.embed(input_ids, position_ids)
        mask, is_causal = self.attention_mask(T, start, attention_mask, input_ids.device)
        for blk in self.blocks:
            x = blk(x, mask, is_causal, cache)
        if cache is not None:
            cache.length = start + T
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary projection with the tied embedding (no bias)."""
        return F.linear(hidden, self.wte.weight)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None, cache: KVCache | None = None) -> GPTOutput:
        """Logits [B, T, V]; with `labels` (already shifted, -100 = ignore) also the mean loss."""
        logits = self.logits(self.hidden_states(input_ids, position_ids, attention_mask, cache))
        loss = lm_loss(logits, labels, loss_mask) if labels is not None else None
        return GPTOutput(logits=logits, loss=loss)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token cross-entropy in fp32, Σ(ce·mask)/Σmask (spec §1.8); label -100 is ignored."""
    labels, weight = token_weights(labels, loss_mask)
    return _TokenCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels, weight)


def token_weights(labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [N], weight [N]): each counted token's share 1/Σmask of the mean loss, 0 elsewhere."""
    labels = labels.reshape(-1)
    mask = (labels != -100).float()
    if loss_mask is not None:
        mask = mask * loss_mask.reshape(-1).float()
    return labels, mask / mask.sum().clamp_min(1.0)


def softmax_ce(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
               with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Σ_i weight_i·ce_i, softmax − onehot [N, V] fp32 or None) of [N, V] logits: one softmax
    pass, shared by `lm_loss` and the chunked frozen-head loss (finetune/head_loss.py)."""
    target = labels.clamp(min=0).unsqueeze(1)
    p = torch.softmax(logits.float(), dim=-1)
    p_y = p.gather(1, target).squeeze(1)
    ce = -torch.log(p_y)
    tiny = p_y < 1e-30  # the softmax underflowed: compute those rows exactly
    if tiny.any():
        rows = tiny.nonzero().squeeze(1)
        x = logits[rows].float()
        ce[rows] = torch.logsumexp(x, dim=-1) - x.gather(1, target[rows]).squeeze(1)
    loss = torch.where(weight != 0, ce * weight, 0.0).sum()
    if not with_grad:
        return loss, None
    p.scatter_add_(1, target, torch.full_like(p_y, -1.0).unsqueeze(1))
    return loss, p


class _TokenCrossEntropy(torch.autograd.Function):
    """Σ_i weight_i·ce_i over [N, V] logits, computed in fp32 with the gradient formed in the forward.

    Same value and gradient as `F.cross_entropy`, but one softmax pass (the gradient is
    softmax − onehot, kept for backward) instead of log-softmax + nll + their backward, and no
    zero-filled [N, V] buffers: with a 50k vocabulary this took the loss from ~10% to ~3% of a
    small GPT's CPU training step.
    """

    @staticmethod
    def forward(ctx, logits, labels, weight):
        loss, p = softmax_ce(logits, labels, weight, ctx.needs_input_grad[0])
        if p is not None:
            ctx.save_for_backward(p, weight)
            ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        p, weight = ctx.saved_tensors
        return p.mul_(weight.unsqueeze(1) * grad).to(ctx.logits_dtype), None, None


def build_model(cfg: ModelConfig, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None) -> GPT:
    """Build a GPT from a resolved model config; `device="meta"` allocates nothing."""
    with torch.device(device or "cpu"):
        model = GPT(cfg)
    if dtype is not None:
        model = model.to(dtype)
    return model
