"""Write any of our models as an HF `transformers` GPT-2 directory with the same logits.

The directory holds `config.json`, `model.safetensors` (or `model-0000k-of-0000N.safetensors`
shards + `model.safetensors.index.json` above `max_shard_size`), `generation_config.json`
(from the Generation section) and the tokenizer files; `GPT2LMHeadModel.from_pretrained(DIR)`
and `AutoTokenizer.from_pretrained(DIR)` load it offline.

Pruned models. GPT-2's config has one global `n_head` (head_dim = n_embd / n_head) and one
global `n_inner`, and transformers 5 dropped `pruned_heads` (GPT2Attention insists on
n_head·head_dim = n_embd), so fewer heads cannot be stored physically. The export
- sets `n_inner` to the widest FFN layer: a uniformly pruned FFN is exported at its real,
  smaller width; narrower layers of a globally pruned model get zero-padded neurons (a zero
  c_fc column and bias gives GELU(0) = 0, and a zero c_proj row adds nothing);
- restores n_embd / head_dim heads per layer by appending zero heads: q = k = 0 gives uniform
  attention over v = 0, and zero c_proj rows add nothing, so the logits are exactly those of
  the pruned model (the attention weights are full-size in this format);
- records the real per-layer shape under `gptforge_pruned_shape` in config.json.

Quantized models (QAT/PTQ fake-quant, or converted INT8). HF GPT-2 has no int8 layers, so
the weights are written as the float values the quantized model multiplies with (fake-quant
weights folded; int8 weights x steps) and activations stay float: the HF model equals ours
with activation quantization switched off. The learned activation scales are kept in
config.json under `gptforge_quantization` for tools that want them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gptforge.errors import CheckpointError, UsageError

DEFAULT_MAX_SHARD_SIZE = "5GB"  # the `save_pretrained` default
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


# ------------------------------------------------------------------------ pruned shapes


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def _pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    if t.shape[1] == cols:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], cols - t.shape[1])], dim=1)


def layer_shapes(model: nn.Module) -> tuple[list[int], list[int]]:
    """Per-layer (heads, FFN width) read from the weights present."""
    heads = [blk.attn.qkv_proj.out_features // (3 * blk.attn.head_dim) for blk in model.blocks]
    return heads, [blk.linear1.out_features for blk in model.blocks]


def padded_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], int, int]:
    """(our-layout float state dict padded to a stock GPT-2 shape, n_head, n_inner)."""
    from gptforge.model_io import state_dict_for_save

    blocks = model.blocks
    hd = blocks[0].attn.head_dim
    hidden = model.wte.weight.shape[1]
    if hidden % hd:
        raise CheckpointError(f"head_dim {hd} does not divide hidden size {hidden}: no GPT-2 config expresses this model")
    full_heads = hidden // hd
    heads, ffns = layer_shapes(model)
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


# ------------------------------------------------------------------------------ configs


def generation_config_dict(g, eos: int | None, padded_ids: range = range(0)) -> dict:
    """HF `GenerationConfig` fields equivalent to our Generation section (`g`; None: defaults).

    Only the fields of the chosen strategy are written (transformers warns about sampling
    fields on a greedy config). `top_k: 0` is written explicitly: HF's default is 50, ours off.
    `padded_ids` (rows of a vocabulary padded past the tokenizer's) are suppressed, as our
    generator never produces them.
    """
    out: dict = {"_from_model_config": g is None}
    if eos is not None:
        out.update(bos_token_id=int(eos), eos_token_id=int(eos), pad_token_id=int(eos))
    if len(padded_ids):
        out["suppress_tokens"] = list(padded_ids)
    if g is None:
        return out
    for key, ours in (("bos_token_id", g.bos_token_id), ("eos_token_id", g.eos_token_id),
                      ("pad_token_id", g.pad_token_id)):
        if ours is not None:
            out[key] = int(ours)
    out.update(max_new_tokens=g.max_dec_len, min_new_tokens=g.min_dec_len)
    if g.repetition_penalty != 1.0:
        out["repetition_penalty"] = g.repetition_penalty
    if g.decode_strategy == "sampling":
        out.update(do_sample=True, top_k=g.top_k, top_p=g.top_p, temperature=g.temperature,
                   num_return_sequences=g.num_return_sequences)
    elif g.decode_strategy == "beam_search":
        out.update(do_sample=False, num_beams=g.num_beams, length_penalty=g.length_penalty,
                   early_stopping=g.early_stopping, num_return_sequences=g.num_return_sequences)
    else:
        out.update(do_sample=False, num_beams=1)
    return out


def _quantization_note(model: nn.Module, kind: str) -> dict:
    from gptforge.transforms.int8 import Int8Linear
    from gptforge.transforms.quant import QuantLinear, qmax_for

    scales, alphas = {}, {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear) and mod.act_quant_enabled and mod.act_type == "moving_average_abs_max":
            scales[name] = float(mod.act_scale.reshape(()))
        elif isinstance(mod, Int8Linear) and mod.input_scale is not None:
            scales[name] = float(mod.input_scale.reshape(())) * qmax_for(mod.act_bits)
        alpha = getattr(mod, "pact_alpha", None)
        if alpha is not None and isinstance(mod, (QuantLinear, Int8Linear)):
            alphas[name] = float(alpha.detach().reshape(()))
    return {"source": kind, "weights": "dequantized (the values the quantized model multiplies with)",
            "activations": "float (the quantization below is not applied by transformers)",
            "activation_abs_max": scales, "pact_alpha": alphas}


# ------------------------------------------------------------------------------ shards


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like `5GB`, `200MB`, `2GiB`, `1000`."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if not m:
            raise UsageError(f"--max-shard-size {size!r}: give bytes or a size like 5GB, 500MB, 2GiB")
        n = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if n <= 0:
        raise UsageError(f"--max-shard-size {size!r}: must be positive")
    return n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shard_state_dict(sd: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive tensors grouped into shards of at most `max_bytes` (a larger tensor gets a
    shard of its own), as `save_pretrained` does."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        n = _nbytes(t)
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def write_safetensors(sd: dict[str, torch.Tensor], dest: Path, max_bytes: int) -> list[str]:
    """`model.safetensors`, or shards + `model.safetensors.index.json`; returns the file names."""
    from safetensors.torch import save_file

    shards = shard_state_dict(sd, max_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(dest / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dest / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in sd.values())}, "weight_map": weight_map}
    (dest / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]


# ------------------------------------------------------------------------------ export


@dataclass
class HFExport:
    out_dir: str
    source_kind: str  # float | fake-quant | int8
    files: list[str] = field(default_factory=list)
    n_head: int = 0
    n_inner: int = 0
    zero_padded: bool = False  # heads or FFN neurons added as zeros to fit GPT-2's config


def hf_parts(model: nn.Module, tokenizer=None, model_cfg=None) -> tuple[dict[str, torch.Tensor], dict, HFExport]:
    """(HF GPT-2 tensors, config.json dict, export facts) for `model` (dense, pruned, fake-quant
    or INT8): quantized weights folded to float, per-layer shapes zero-padded to a uniform one."""
    import dataclasses

    from gptforge.export.common import check_plain_linears, fold_quantization, model_kind
    from gptforge.model import convert

    check_plain_linears(model, "the HF export")
    kind = model_kind(model)
    plain = fold_quantization(model)
    sd, n_head, n_inner = padded_state_dict(plain)
    hd = plain.blocks[0].attn.head_dim
    hf = convert.ours_to_hf(convert.regroup_qkv(sd, hd, to_grouped=True), len(plain.blocks))
    heads, ffns = layer_shapes(plain)
    base = model_cfg or model.config
    shape_cfg = dataclasses.replace(base, num_attention_heads=n_head, ffn_hidden_size=n_inner, head_dim=hd,
                                    layer_num_heads=None, layer_ffn_sizes=None,
                                    vocab_size=int(plain.wte.weight.shape[0]))
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    config = convert.model_to_hf_config(shape_cfg, eos)
    if eos is None:  # GPT2Config would otherwise default them to 50256, maybe outside this vocabulary
        config.update(bos_token_id=None, eos_token_id=None)
    padded = any(h != n_head for h in heads) or any(f != n_inner for f in ffns)
    if padded:
        config["gptforge_pruned_shape"] = {"head_dim": hd, "layer_num_heads": heads, "layer_ffn_sizes": ffns}
    if kind != "float":
        config["gptforge_quantization"] = _quantization_note(model, kind)
    facts = HFExport("", kind, n_head=n_head, n_inner=n_inner, zero_padded=padded)
    return hf, config, facts


def save_hf(model: nn.Module, out_dir: str | os.PathLike, tokenizer=None, *, generation=None, model_cfg=None,
            max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False) -> HFExport:
    """Write `model` (dense, pruned, fake-quant or INT8) as an HF GPT-2 directory whose
    logits in `transformers` equal ours (quantized models: with activation quantization
    off). `generation` is our Generation section (written as generation_config.json);
    `model_cfg` supplies dropout/init values (default: `model.config`)."""
    from gptforge.model_io import atomic_dir

    max_bytes = parse_size(max_shard_size)
    hf, config, result = hf_parts(model, tokenizer, model_cfg)
    result.out_dir = str(out_dir)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    with atomic_dir(out_dir, overwrite) as tmp:
        result.files = write_safetensors(hf, tmp, max_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        vocab = int(config["vocab_size"])
        unused_ids = range(tokenizer.vocab_size, vocab) if tokenizer is not None else range(0)
        gen = generation_config_dict(generation, eos, unused_ids)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        result.files += ["config.json", "generation_config.json"]
        if tokenizer is not None:
            tokenizer.save(tmp)
            result.files += sorted(p.name for p in tmp.iterdir() if p.name not in result.files)
    return result


def save_pruned_hf_dir(model: nn.Module, model_cfg, out_dir: str | os.PathLike, tokenizer=None,
                       overwrite: bool = False) -> Path:
    """`save_hf` under the name `gptforge prune --hf-out` has used (float models only)."""
    from gptforge.export.common import FLOAT, model_kind

    if model_kind(model) != FLOAT:
        raise UsageError("the pruned-model HF writer takes float models; use `gptforge export --format hf` "
                         "for quantized ones")
    save_hf(model, out_dir, tokenizer, model_cfg=model_cfg, overwrite=overwrite)
    return Path(out_dir)
