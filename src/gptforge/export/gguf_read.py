"""Read a GPT-2 GGUF file (ours or llama.cpp's converter's) back as an HF GPT-2 directory, which
`gptforge convert` then loads like any HF checkpoint (one implementation of the layouts).

Tensors are dequantized by the `gguf` package (f32, f16, bf16, q8_0, q4_0, q4_1, q5_*, the
K-quants: whatever it can dequantize); the names map back through the same gguf tensor-name map
the export uses; the tokenizer is rebuilt from the file's tokens and merges.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from gptforge.errors import CheckpointError

_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


def _hf_names(n_layer: int) -> list[str]:
    names = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"]
    for i in range(n_layer):
        for part in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names += [f"transformer.h.{i}.{part}.weight", f"transformer.h.{i}.{part}.bias"]
    return names


def _fields(reader, source: str) -> dict:
    fields = {}
    for key, f in reader.fields.items():
        try:
            fields[key] = f.contents()
        except Exception:  # noqa: BLE001 - a value of a type we never read
            continue
    if fields.get("general.architecture") != "gpt2":
        raise CheckpointError(f"{source}: general.architecture is {fields.get('general.architecture')!r}; "
                              "only gpt2 GGUF files import")
    return fields


def _tensor(t, source: str) -> torch.Tensor:
    import gguf

    try:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise CheckpointError(f"{source}: tensor {t.name} is {t.tensor_type.name}, which the gguf package "
                              "cannot dequantize") from None
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dimensions innermost first
    return torch.from_numpy(np.array(a, dtype=np.float32).reshape(shape))  # a copy: the reader maps the file


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict, object]:
    """(HF GPT-2 state dict in float32, config.json dict, our Tokenizer) of a gpt2 GGUF file."""
    import gguf

    from gptforge.export.gguf_vocab import tokenizer_from_gguf

    source = str(path)
    if not Path(path).is_file():
        raise CheckpointError(f"{source}: GGUF file not found")
    try:
        reader = gguf.GGUFReader(source)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise CheckpointError(f"{source}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    fields = _fields(reader, source)
    try:
        n_layer = int(fields["gpt2.block_count"])
        hidden = int(fields["gpt2.embedding_length"])
        config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": n_layer, "n_embd": hidden,
                  "n_head": int(fields["gpt2.attention.head_count"]),
                  "n_positions": int(fields["gpt2.context_length"]),
                  "n_inner": int(fields.get("gpt2.feed_forward_length") or 4 * hidden),
                  "layer_norm_epsilon": float(fields["gpt2.attention.layer_norm_epsilon"]),
                  "activation_function": "gelu_new", "tie_word_embeddings": True}
    except KeyError as e:
        raise CheckpointError(f"{source}: missing GGUF key {e.args[0]}") from None
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, n_layer)
    hf_of = {names.get_name(n, try_suffixes=(".weight", ".bias")): n for n in _hf_names(n_layer)}
    tensors = {t.name: t for t in reader.tensors}
    sd = {}
    for gname, hf in hf_of.items():
        if gname not in tensors:
            raise CheckpointError(f"{source}: tensor {gname} is missing")
        w = _tensor(tensors[gname], source)
        sd[hf] = w.t().contiguous() if hf.endswith(_CONV1D) else w
    if "output.weight" in tensors and not torch.equal(_tensor(tensors["output.weight"], source),
                                                     sd["transformer.wte.weight"]):
        raise CheckpointError(f"{source}: output.weight differs from token_embd.weight; this model "
                              "ties its head to the embedding, so an untied head cannot import")
    config["vocab_size"] = int(sd["transformer.wte.weight"].shape[0])
    eos = fields.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["bos_token_id"] = config["eos_token_id"] = int(eos)
    return sd, config, tokenizer_from_gguf(fields, source)


@contextlib.contextmanager
def gguf_as_hf_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary HF GPT-2 directory holding the GGUF file's model and tokenizer."""
    from safetensors.torch import save_file

    sd, config, tok = read_gguf(path)
    with tempfile.TemporaryDirectory(prefix="gptforge-gguf-") as d:
        save_file(sd, str(Path(d) / "model.safetensors"), metadata={"format": "pt"})
        (Path(d) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tok.save(d)
        yield Path(d)
