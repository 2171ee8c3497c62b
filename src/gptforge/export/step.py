"""The graph every exported program computes: one decoding step with explicit past keys/values.

    logits, present_key_0, present_value_0, ... = step(input_ids, position_ids, attention_mask,
                                                        logits_index, past_key_0, past_value_0, ...)

| name | shape | meaning |
|---|---|---|
| `input_ids` | [batch, seq] int64 | new tokens (the whole prompt at prefill, one token per row after) |
| `position_ids` | [batch, seq] int64 | their positions (left-padded rows count real tokens only) |
| `attention_mask` | [batch, past + seq] int64 | 1 = a real token, 0 = padding, over past and new positions |
| `logits_index` | [num_logits] int64 | which of the `seq` new positions get logits (`[seq-1]` to decode, `0..seq-1` to score) |
| `past_key_i`, `past_value_i` | [batch, heads_i, past, head_dim] fp32 | layer i's cache; `past` may be 0 (prefill) |
| `logits` | [batch, num_logits, vocab] fp32 | |
| `present_key_i`, `present_value_i` | [batch, heads_i, past + seq, head_dim] | the cache to pass as `past_*` next step |

`heads_i` is read from each layer's weights, so pruned models with per-layer head counts export
too. Projecting only `logits_index` keeps the prefill of a long prompt from paying for a
vocabulary projection of every position (as our PyTorch generator does).

The step runs our GPT's own `hidden_states` with a cache object that concatenates instead of
writing into preallocated buffers (exported graphs cannot mutate their inputs).
"""

from __future__ import annotations

import torch
from torch import nn


class _ConcatCache:
    """The `KVCache` interface over explicit past tensors; collects the present tensors.

    `length` (the position where new tokens start) is taken from the attention mask, which
    covers past + new positions, so the graph has one place that defines it."""

    def __init__(self, past: list[torch.Tensor], length):
        self.past = past
        self.length = length
        self.present: list[torch.Tensor | None] = [None] * len(past)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([self.past[2 * layer], k], dim=2)
        v = torch.cat([self.past[2 * layer + 1], v], dim=2)
        self.present[2 * layer], self.present[2 * layer + 1] = k, v
        return k, v


class StepModel(nn.Module):
    """Wraps our GPT (float, or with QDQ modules) as the step function of the module docstring."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, logits_index, *past):
        start = attention_mask.shape[1] - input_ids.shape[1]
        cache = _ConcatCache(list(past), start)
        mask = step_mask(attention_mask, input_ids.shape[1], start)
        h = self.model.hidden_states(input_ids, position_ids, mask, cache)
        logits = self.model.logits(h.index_select(1, logits_index))
        return (logits, *cache.present)


def step_mask(key_mask: torch.Tensor, T: int, start) -> torch.Tensor:
    """[B, 1, T, start+T] boolean mask of `GPT.attention_mask` for a 2-D key mask: causal from
    `start`, padding hidden, and each query always sees itself (so padded rows stay finite).
    Built with index comparisons because `roll` by a symbolic shift does not export to ONNX."""
    Tk = key_mask.shape[1]
    q = torch.arange(T, device=key_mask.device)[:, None] + start
    k = torch.arange(Tk, device=key_mask.device)[None, :]
    mask = (k <= q)[None] & key_mask.bool()[:, None, :]
    return (mask | (k == q)[None])[:, None]


def layer_heads(model: nn.Module) -> list[int]:
    """Heads per layer, from the fused QKV weight present (QDQ weights are stored [in, out])."""
    out = []
    for blk in model.blocks:
        qkv = blk.attn.qkv_proj
        width = getattr(qkv, "out_features", None) or qkv.weight.shape[0]
        out.append(int(width) // (3 * blk.attn.head_dim))
    return out


def input_names(num_layers: int) -> list[str]:
    return ["input_ids", "position_ids", "attention_mask", "logits_index",
            *(f"past_{kv}_{i}" for i in range(num_layers) for kv in ("key", "value"))]


def output_names(num_layers: int) -> list[str]:
    return ["logits", *(f"present_{kv}_{i}" for i in range(num_layers) for kv in ("key", "value"))]


def example_inputs(model: nn.Module, batch: int = 2, seq: int = 5, past: int = 3) -> tuple[torch.Tensor, ...]:
    """Inputs to trace with: sizes other than 0/1 so that no dimension is specialised."""
    hd = model.blocks[0].attn.head_dim
    vocab = int(model.wte.weight.shape[0])
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    index = torch.tensor([seq - 2, seq - 1])
    caches = []
    for h in layer_heads(model):
        caches += [torch.zeros(batch, h, past, hd), torch.zeros(batch, h, past, hd)]
    return (ids, pos, mask, index, *caches)


def dynamic_shapes(num_layers: int, max_positions: int) -> dict:
    """torch.export dynamic dimensions: batch, seq (>= 1), past (>= 0), their sum, num_logits."""
    from torch.export import Dim

    batch = Dim("batch", min=1, max=4096)
    seq = Dim("seq", min=1, max=max_positions)
    past = Dim("past", min=0, max=max_positions)
    total = Dim("total", min=1, max=2 * max_positions)
    nlog = Dim("num_logits", min=1, max=max_positions)
    cache = {0: batch, 2: past}
    return {"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq},
            "attention_mask": {0: batch, 1: total}, "logits_index": {0: nlog},
            "past": tuple(cache for _ in range(2 * num_layers))}


@torch.no_grad()
def teacher_forced_logits(run, heads: list[int], head_dim: int, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits [B, T, V] for every position of `ids` [B, T] computed through a step function
    `run(list of input tensors) -> list of output tensors` (a StepModel, a loaded `.pt2`, an
    onnxruntime session): a prefill of `prompt_len` tokens scoring every position, then one
    token per step through the returned cache. Equal to a plain forward over `ids`."""
    B, T = ids.shape
    past: list[torch.Tensor] = []
    for h in heads:
        past += [torch.zeros(B, h, 0, head_dim), torch.zeros(B, h, 0, head_dim)]
    pos = torch.arange(prompt_len).expand(B, prompt_len).contiguous()
    out = run([ids[:, :prompt_len].contiguous(), pos, torch.ones(B, prompt_len, dtype=torch.long),
               torch.arange(prompt_len), *past])
    logits, past = [out[0]], list(out[1:])
    for t in range(prompt_len, T):
        out = run([ids[:, t:t + 1].contiguous(), torch.full((B, 1), t, dtype=torch.long),
                   torch.ones(B, t + 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), *past])
        logits.append(out[0])
        past = list(out[1:])
    return torch.cat(logits, dim=1)


@torch.no_grad()
def cached_logits(model: nn.Module, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The same calls as `teacher_forced_logits` made on a PyTorch GPT through its own
    `KVCache` (per-call activation scales see the same tensors as in the exported program)."""
    B, T = ids.shape
    cache = model.new_cache(B, T)
    out = [model(ids[:, :prompt_len], cache=cache).logits]
    out += [model(ids[:, t:t + 1], cache=cache).logits for t in range(prompt_len, T)]
    return torch.cat(out, dim=1)
