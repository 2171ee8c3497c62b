"""Write a pruned model as an HF `transformers` GPT-2 directory with the same logits.

GPT-2's config has one global `n_head` (with head_dim = n_embd / n_head) and one global
`n_inner`. transformers 5 removed `pruned_heads` (GPT2Attention now insists on
n_head·head_dim = n_embd), so fewer heads cannot be stored physically. The export therefore:
- sets `n_inner` to the widest FFN layer: a uniformly pruned FFN is exported at its real,
  smaller width; narrower layers of a globally pruned model get zero-padded neurons (a zero
  c_fc column and bias gives GELU(0) = 0, and a zero c_proj row adds nothing);
- restores `n_head = n_embd / head_dim` heads per layer by appending zero heads: q = k = 0
  gives uniform attention over v = 0, and zero c_proj rows add nothing, so the logits are
  exactly those of the pruned model (the attention weights are full-size in this format);
- records the real per-layer shape under `gptforge_pruned_shape` in config.json.

Our own model directory (`config.yaml` + `model.safetensors`) stays physically small; this
format is for tools that read stock GPT-2 checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import nn

from gptforge.errors import CheckpointError, UsageError


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def _pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    if t.shape[1] == cols:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], cols - t.shape[1])], dim=1)


def padded_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], int, int]:
    """(our-layout state dict padded to a stock GPT-2 shape, n_head, n_inner)."""
    from gptforge.compress.prune import layer_shapes_of
    from gptforge.model_io import state_dict_for_save

    blocks = model.blocks
    hd = blocks[0].attn.head_dim
    hidden = model.wte.weight.shape[1]
    if hidden % hd:
        raise CheckpointError(f"head_dim {hd} does not divide hidden size {hidden}: no GPT-2 config expresses this model")
    full_heads = hidden // hd
    heads, ffns = layer_shapes_of(model)
    if max(heads) > full_heads:
        raise CheckpointError(f"a layer has {max(heads)} heads of {hd}, more than n_embd/head_dim = {full_heads}")
    n_inner = max(ffns)
    sd = state_dict_for_save(model)
    for i in range(len(blocks)):
        p = f"blocks.{i}."
        sd[p + "attn.qkv_proj.weight"] = _pad_rows(sd[p + "attn.qkv_proj.weight"], 3 * full_heads * hd)
        sd[p + "attn.qkv_proj.bias"] = _pad_rows(sd[p + "attn.qkv_proj.bias"], 3 * full_heads * hd)
        sd[p + "attn.out_proj.weight"] = _pad_cols(sd[p + "attn.out_proj.weight"], full_heads * hd)
        sd[p + "linear1.weight"] = _pad_rows(sd[p + "linear1.weight"], n_inner)
        sd[p + "linear1.bias"] = _pad_rows(sd[p + "linear1.bias"], n_inner)
        sd[p + "linear2.weight"] = _pad_cols(sd[p + "linear2.weight"], n_inner)
    return sd, full_heads, n_inner


def save_pruned_hf_dir(model: nn.Module, model_cfg, out_dir: str | os.PathLike, tokenizer=None,
                       overwrite: bool = False) -> Path:
    """Write `config.json`, `model.safetensors`, `generation_config.json` (+ tokenizer files)
    that `transformers.GPT2LMHeadModel.from_pretrained` loads with this model's logits.

    Works for dense, uniformly and globally pruned, and 2:4-sparse float models (not for
    fake-quant models: convert or export those with their own tools).
    """
    from safetensors.torch import save_file

    from gptforge.compress.prune import layer_shapes_of
    from gptforge.model import convert
    from gptforge.model_io import atomic_dir

    for i, blk in enumerate(model.blocks):
        for name in ("attn.qkv_proj", "attn.out_proj", "linear1", "linear2"):
            if type(blk.get_submodule(name)) is not nn.Linear:
                raise UsageError(f"blocks.{i}.{name} is a {type(blk.get_submodule(name)).__name__}, not a plain "
                                 "Linear: HF export of quantized models is not done here")
    sd, n_head, n_inner = padded_state_dict(model)
    sd = convert.regroup_qkv(sd, model.blocks[0].attn.head_dim, to_grouped=True)
    hf = convert.ours_to_hf(sd, len(model.blocks))
    heads, ffns = layer_shapes_of(model)
    shape_cfg = dataclasses.replace(model_cfg, num_attention_heads=n_head, ffn_hidden_size=n_inner,
                                    layer_num_heads=None, layer_ffn_sizes=None)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    config = convert.model_to_hf_config(shape_cfg, eos)
    config["gptforge_pruned_shape"] = {"head_dim": model.blocks[0].attn.head_dim,
                                       "layer_num_heads": heads, "layer_ffn_sizes": ffns}
    with atomic_dir(out_dir, overwrite) as tmp:
        save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        gen = {"_from_model_config": True}
        if eos is not None:
            gen.update(bos_token_id=eos, eos_token_id=eos)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if tokenizer is not None:
            tokenizer.save(tmp)
    return Path(out_dir)
