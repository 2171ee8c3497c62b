"""The GPT model: parameter counts, init, cache and padding semantics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gf_testutil import tiny_model
from gptforge.config import load_config
from gptforge.config.presets import reference_param_count
from gptforge.model import build_model


@pytest.mark.parametrize("preset,billions", [("345M", 0.355), ("1.3B", 1.314), ("6.7B", 6.654),
                                             ("13B", 12.86), ("175B", 174.6)])
def test_preset_param_counts_on_meta(preset, billions):
    cfg = load_config(overrides=[f"Model.preset={preset}"])
    model = build_model(cfg.Model, device="meta")
    n = model.num_parameters()
    m = cfg.Model
    assert n == reference_param_count(m.vocab_size, m.max_position_embeddings, m.hidden_size, m.num_layers)
    assert round(n / 1e9, 3 if billions < 10 else 2 if billions < 100 else 1) == billions
    # no storage anywhere: a 175B model is built without allocating its weights
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def test_init_follows_reference():
    cfg = load_config(overrides=["Model.preset=tiny", "Model.hidden_size=256", "Model.num_layers=8",
                                 "Model.ffn_hidden_size=1024"])
    model = build_model(cfg.Model)
    L = cfg.Model.num_layers
    w_qkv = torch.cat([b.attn.qkv_proj.weight.flatten() for b in model.blocks])
    w_out = torch.cat([b.linear2.weight.flatten() for b in model.blocks])
    assert abs(w_qkv.std().item() - 0.02) < 1e-3
    assert abs(w_out.std().item() - 0.02 / math.sqrt(2 * L)) < 3e-4
    assert all(b.attn.qkv_proj.bias.abs().sum() == 0 for b in model.blocks)
    cfg.Model.scale_output_init = False
    flat = build_model(cfg.Model)
    assert abs(torch.cat([b.linear2.weight.flatten() for b in flat.blocks]).std().item() - 0.02) < 1e-3


def test_loss_is_masked_mean_cross_entropy():
    model, _ = tiny_model()
    x = torch.randint(0, 4096, (2, 9))
    y = torch.randint(0, 4096, (2, 9))
    mask = torch.ones(2, 9)
    mask[1, 5:] = 0
    out = model(x, labels=y, loss_mask=mask)
    ce = F.cross_entropy(out.logits.reshape(-1, 4096), y.reshape(-1), reduction="none")
    assert torch.allclose(out.loss, (ce * mask.reshape(-1)).sum() / mask.sum(), atol=1e-6)


def test_head_is_tied_to_embedding():
    model, _ = tiny_model()
    h = torch.randn(1, 3, model.config.hidden_size)
    assert torch.allclose(model.logits(h), h @ model.wte.weight.T, atol=1e-6)
    assert not any("head" in n for n, _ in model.named_parameters())


@torch.no_grad()
def test_kv_cache_equals_full_recompute():
    model, _ = tiny_model()
    x = torch.randint(0, 4096, (3, 20))
    full = model(x).logits
    cache = model.new_cache(3, 32)
    parts = [model(x[:, :7], cache=cache).logits, model(x[:, 7:12], cache=cache).logits]
    parts += [model(x[:, i:i + 1], cache=cache).logits for i in range(12, 20)]
    assert cache.length == 20
    assert torch.allclose(full, torch.cat(parts, 1), atol=1e-5)


@torch.no_grad()
def test_left_padding_matches_unpadded_sequences():
    model, _ = tiny_model()
    a = torch.randint(0, 4096, (1, 6))
    b = torch.randint(0, 4096, (1, 10))
    pad = torch.full((1, 4), 7)
    batch = torch.cat([torch.cat([pad, a], 1), b])
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :4] = 0
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    out = model(batch, position_ids=pos, attention_mask=mask).logits
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0, 4:], model(a).logits[0], atol=1e-5)
    assert torch.allclose(out[1], model(b).logits[0], atol=1e-5)
    # Incremental decoding with the padding mask gives the same next-token logits.
    cache = model.new_cache(2, 16)
    model(batch, position_ids=pos, attention_mask=mask, cache=cache)
    nxt = torch.tensor([[11], [12]])
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    step = model(nxt, position_ids=pos[:, -1:] + 1, attention_mask=mask2, cache=cache).logits
    ref_a = model(torch.cat([a, nxt[:1]], 1)).logits[0, -1]
    assert torch.allclose(step[0, -1], ref_a, atol=1e-5)


def test_dropout_only_in_training():
    cfg = load_config(overrides=["Model.preset=tiny"])
    model = build_model(cfg.Model)
    x = torch.randint(0, 4096, (2, 8))
    model.eval()
    assert torch.equal(model(x).logits, model(x).logits)
    model.train()
    assert not torch.equal(model(x).logits, model(x).logits)


def test_non_uniform_layer_shapes_build_and_run():
    cfg = load_config(overrides=["Model.preset=tiny", "Model.layer_num_heads=[4,2]", "Model.layer_ffn_sizes=[256,96]"])
    model = build_model(cfg.Model).eval()
    assert model.blocks[1].attn.qkv_proj.out_features == 3 * 2 * 16
    assert model.blocks[1].linear1.out_features == 96
    x = torch.randint(0, 4096, (2, 8))
    cache = model.new_cache(2, 8)
    assert torch.allclose(model(x).logits, model(x, cache=cache).logits, atol=1e-6)


def test_recompute_units_exist():
    model, _ = tiny_model()
    blk = model.blocks[0]
    # full / full_attn / core_attn are whole modules that can be wrapped from outside.
    assert isinstance(blk, torch.nn.Module) and isinstance(blk.attn, torch.nn.Module)
    assert isinstance(blk.attn.core, torch.nn.Module)


@pytest.mark.parametrize("moe", [(), ("Model.num_experts=4", "Model.expert_interval=2")])
def test_block_linears_are_every_linear_of_the_blocks(moe):
    """The names the model publishes (quantization, sparsity, export and tensor parallel walk them)
    are exactly the blocks' nn.Linear layers, block by block in the reference's order; an MoE
    block's gate and experts are not among them."""
    from torch import nn

    from gptforge.model import BLOCK_LINEARS, block_linears

    model, cfg = tiny_model("Model.num_layers=3", *moe)
    walked = list(block_linears(model))
    linears = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n.startswith("blocks.") and ".moe." not in n]
    assert [n for n, _ in walked] == [n for n, _ in linears]
    assert all(a is b for (_, a), (_, b) in zip(walked, linears, strict=True))
    dense = [i for i, blk in enumerate(model.blocks) if blk.moe is None]
    assert [n for n, _ in walked if n.endswith("linear2")] == [f"blocks.{i}.linear2" for i in dense]
    assert len(dense) == (3 if not moe else 2)
    assert walked[0][0] == f"blocks.0.{BLOCK_LINEARS[0]}" and BLOCK_LINEARS[0] == "attn.qkv_proj"
