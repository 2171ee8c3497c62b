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
most. `q4_k` (llama.cpp's Q4_K_M mix) is written by llama.cpp's own quantizer through the optional
`llama-cpp-python` package: the `gguf` package has no K-quant quantizer (dequantize only), and a
second implementation of llama.cpp's search for K-quant scales would be a copy kept equal by hand.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch import nn

from gptforge.errors import UsageError

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_k")
LLAMA_QUANTIZED = {"q4_k": 15}  # LLAMA_FTYPE_MOSTLY_Q4_K_M: made by llama.cpp from our f32 file
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
    if t not in GGUF_TYPES:
        raise UsageError(f"--gguf-type {gguf_type!r}: choose one of {', '.join(GGUF_TYPES)}")
    return t


def llama_quantizer(gguf_type: str):
    """llama.cpp's `llama_cpp` module for a type only its quantizer writes (else None); a one-line
    UsageError when the optional extra is absent."""
    if gguf_type not in LLAMA_QUANTIZED:
        return None
    try:
        import llama_cpp
    except ImportError:
        raise UsageError(f"--gguf-type {gguf_type}: written by llama.cpp's own K-quant quantizer, which needs "
                         "llama-cpp-python (pip install 'gptforge[llama]'; it compiles llama.cpp); or choose "
                         + ", ".join(t for t in GGUF_TYPES if t not in LLAMA_QUANTIZED)) from None
    return llama_cpp


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
    llama_cpp = llama_quantizer(gguf_type)
    if tokenizer is None:
        raise UsageError("a GGUF file carries its tokenizer: give the model's tokenizer")
    tensors, config, facts = gguf_tensors(model, tokenizer, model_cfg)
    vocab = vocab_from_tokenizer(tokenizer, facts.n_vocab)
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    written = "f32" if llama_cpp else gguf_type  # llama.cpp quantizes from the exact file
    quantized = tmp.with_name(tmp.name + ".q")
    try:
        with disk_full_guard(out):
            _add_hparams(writer, config, written, name or out.stem)
            add_vocab(writer, vocab)
            for tname, a in tensors.items():
                data, qtype = _encode(tname, a, written, facts)
                writer.add_tensor(tname, data, raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file(progress=False)
            writer.close()
            if llama_cpp:
                llama_quantize(llama_cpp, tmp, quantized, LLAMA_QUANTIZED[gguf_type])
                os.replace(quantized, tmp)
                facts.tensor_types = stored_types(tmp)
            fsync_path(tmp)
            os.replace(tmp, out)
            fsync_path(out.parent)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
        quantized.unlink(missing_ok=True)
    facts.path, facts.gguf_type, facts.bytes = str(out), gguf_type, out.stat().st_size
    return facts



def llama_quantize(llama_cpp, src: Path, dst: Path, ftype: int) -> None:
    """`llama_model_quantize(src -> dst)` with llama.cpp's log kept off the terminal (shown on failure)."""
    import ctypes
    import tempfile

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)  # the C library writes its progress to fd 2
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if rc != 0:
            log.seek(0)
            tail = [ln for ln in log.read().decode(errors="replace").splitlines() if ln.strip()][-1:]
            raise UsageError(f"llama.cpp's quantizer failed on {src.name} (code {rc}): {' '.join(tail) or 'no message'}")


def stored_types(path: Path) -> dict[str, str]:
    """{tensor name: GGML type name} of a GGUF file."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
