"""Write any of our models as a GGUF file that llama.cpp runs (architecture `gpt2`).

The file is written by the `gguf` package (llama.cpp's own writer and quantizers). The tensors
are those of the HF export (`export/hf.py`: quantized models folded to float, pruned layers
zero-padded to GPT-2's uniform shape, fused QKV in q|k|v order), renamed by the `gguf` package's
tensor-name map as llama.cpp's `convert_hf_to_gguf.py` does for `GPT2LMHeadModel`:

| ours | GGUF | stored as |
|---|---|---|
| `wte` (tied head) | `token_embd.weight` | the chosen type; `q4_0` files keep it at `q8_0` |
| `wpe` | `position_embd.weight` | f32 (llama.cpp's converter never quantizes it) |
| `blocks.i.norm1/2`, `norm` | `blk.i.attn_norm`, `blk.i.ffn_norm`, `output_norm` | f32 |
| `blocks.i.attn.qkv_proj` | `blk.i.attn_qkv` (rows q\\|k\\|v) | the chosen type; biases f32 |
| `blocks.i.attn.out_proj` | `blk.i.attn_output` | the chosen type; biases f32 |
| `blocks.i.linear1/2` | `blk.i.ffn_up`, `blk.i.ffn_down` | the chosen type; biases f32 |

There is no `output.weight`: llama.cpp's gpt2 graph uses `token_embd` as the head when it is
absent. A 2-D tensor whose rows are not a whole number of quantization blocks (32 values) is
stored as f16, as llama.cpp's converter falls back. The vocabulary rows a padded vocabulary adds
past the tokenizer's are left out: llama.cpp needs one token per `token_embd` row, and our
generator never produces those ids (the tokenizer never emits them), so the logits of every
real token are unchanged.

`q4_0` keeps the tied embedding / head at `q8_0` (llama.cpp's `llama-quantize` likewise keeps the
output matrix at a higher precision than the blocks): at 4 bits the head costs small models the
most. `q4_k` is not offered: the `gguf` package has no K-quant quantizer (dequantize only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch import nn

from gptforge.errors import UsageError

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0")
ARCH = "gpt2"


@dataclass
class GGUFExport:
    path: str
    gguf_type: str
    source_kind: str              # float | fake-quant | int8
    n_vocab: int                  # tokens (= token_embd rows) in the file
    dropped_rows: int = 0         # padded-vocabulary rows left out
    n_head: int = 0
    n_inner: int = 0
    zero_padded: bool = False     # pruned heads / FFN neurons restored as zeros
    tensor_types: dict[str, str] = field(default_factory=dict)
    f16_fallback: list[str] = field(default_factory=list)  # rows not whole blocks: stored f16
    bytes: int = 0


def check_gguf_type(gguf_type: str) -> str:
    """`gguf_type` if the export writes it, else a one-line UsageError."""
    t = str(gguf_type).lower()
    if t == "q4_k":
        raise UsageError("--gguf-type q4_k: the gguf package has no K-quant quantizer (it only dequantizes "
                         "them); choose one of " + ", ".join(GGUF_TYPES))
    if t not in GGUF_TYPES:
        raise UsageError(f"--gguf-type {gguf_type!r}: choose one of {', '.join(GGUF_TYPES)}")
    return t


def _qtype(name: str, gguf_type: str):
    """The GGML type of tensor `name` in a `gguf_type` file (llama.cpp converter's rules)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if not name.endswith(".weight") or "norm" in name or name.startswith("position_embd"):
        return Q.F32
    if gguf_type == "q4_0" and name.startswith("token_embd"):
        return Q.Q8_0
    return {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[gguf_type]


def gguf_tensors(model: nn.Module, tokenizer, model_cfg=None) -> tuple[dict[str, np.ndarray], dict, GGUFExport]:
    """({GGUF name: float32 array [out, in]}, HF config dict, export facts) for `model`."""
    import gguf

    from gptforge.export.hf import hf_parts

    hf, config, facts = hf_parts(model, tokenizer, model_cfg)
    n_tok = tokenizer.vocab_size
    rows = int(config["vocab_size"])
    if n_tok > rows:
        raise UsageError(f"the tokenizer has {n_tok} tokens but the model only {rows} embedding rows; "
                         "export the model with the tokenizer it was trained with")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, int(config["n_layer"]))
    out: dict[str, np.ndarray] = {}
    for hf_name, t in hf.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UsageError(f"{hf_name}: no GGUF gpt2 tensor name for it")
        a = t.detach().float().cpu()
        if hf_name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            a = a.t()  # Conv1D [in, out] -> [out, in], as the converter transposes
        if name == "token_embd.weight":
            a = a[:n_tok]
        out[name] = np.ascontiguousarray(a.numpy(), dtype=np.float32)
    facts.n_vocab, facts.dropped_rows = n_tok, rows - n_tok
    return out, config, _as_gguf_facts(facts)


def _as_gguf_facts(hf_facts) -> GGUFExport:
    return GGUFExport("", "", hf_facts.source_kind, getattr(hf_facts, "n_vocab", 0),
                      getattr(hf_facts, "dropped_rows", 0), hf_facts.n_head, hf_facts.n_inner, hf_facts.zero_padded)


def _add_hparams(writer, config: dict, gguf_type: str, name: str) -> None:
    import gguf

    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[gguf_type]
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_block_count(int(config["n_layer"]))
    writer.add_context_length(int(config["n_positions"]))
    writer.add_embedding_length(int(config["n_embd"]))
    writer.add_feed_forward_length(int(config["n_inner"]))
    writer.add_head_count(int(config["n_head"]))
    writer.add_layer_norm_eps(float(config["layer_norm_epsilon"]))
    writer.add_file_type(int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _encode(name: str, a: np.ndarray, gguf_type: str, facts: GGUFExport):
    """(array to store, GGML type) for one tensor: quantized by the gguf package."""
    import gguf

    qtype = _qtype(name, gguf_type)
    try:
        data = gguf.quants.quantize(a, qtype)
    except gguf.QuantError:  # rows not a whole number of blocks
        qtype = gguf.GGMLQuantizationType.F16
        data = gguf.quants.quantize(a, qtype)
        facts.f16_fallback.append(name)
    facts.tensor_types[name] = qtype.name
    return data, qtype


def save_gguf(model: nn.Module, path: str | os.PathLike, tokenizer, gguf_type: str = "f32", *, model_cfg=None,
              name: str | None = None) -> GGUFExport:
    """Write `model` (dense, pruned, fake-quant or INT8) and `tokenizer` as one GGUF file for
    llama.cpp's `gpt2` architecture. The file appears whole or not at all (temp + fsync +
    rename); a full disk is a DiskFullError naming it."""
    import gguf

    from gptforge.durable import fsync_path
    from gptforge.export.gguf_vocab import add_vocab, vocab_from_tokenizer
    from gptforge.fsguard import disk_full_guard

    gguf_type = check_gguf_type(gguf_type)
    if tokenizer is None:
        raise UsageError("a GGUF file carries its tokenizer: give the model's tokenizer")
    tensors, config, facts = gguf_tensors(model, tokenizer, model_cfg)
    vocab = vocab_from_tokenizer(tokenizer, facts.n_vocab)
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    try:
        with disk_full_guard(out):
            _add_hparams(writer, config, gguf_type, name or out.stem)
            add_vocab(writer, vocab)
            for tname, a in tensors.items():
                data, qtype = _encode(tname, a, gguf_type, facts)
                writer.add_tensor(tname, data, raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file(progress=False)
            writer.close()
            fsync_path(tmp)
            os.replace(tmp, out)
            fsync_path(out.parent)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    facts.path, facts.gguf_type, facts.bytes = str(out), gguf_type, out.stat().st_size
    return facts

