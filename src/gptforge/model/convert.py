"""Weights in and out: HF `transformers` GPT-2 directories and PaddleFleetX `.pdparams` files.

Layouts (spec §1.2, §1.9):
- Ours: `nn.Linear` weights [out, in]; fused QKV rows grouped per head: [q_h, k_h, v_h] × heads.
- HF GPT-2: `Conv1D` weights [in, out]; c_attn columns [q (all heads) | k | v].
- Paddle: `Linear` weights [in, out]; fused qkv columns already grouped per head like ours;
  unfused q/k/v_proj are [h, h] each.
Head counts per layer are read from the tensor shapes, so checkpoints whose layers have fewer
heads or narrower FFNs than the config's nominal size import as well.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptforge.errors import CheckpointError

# --------------------------------------------------------------------------- QKV layout


def qkv_from_grouped(w: torch.Tensor, heads: int) -> torch.Tensor:
    """[q_all; k_all; v_all] rows (dim 0) → per-head [q_h; k_h; v_h] rows. Works for bias too."""
    rest = w.shape[1:]
    hd = w.shape[0] // (3 * heads)
    return w.reshape(3, heads, hd, *rest).transpose(0, 1).reshape(3 * heads * hd, *rest).contiguous()


def qkv_to_grouped(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `qkv_from_grouped`."""
    rest = w.shape[1:]
    hd = w.shape[0] // (3 * heads)
    return w.reshape(heads, 3, hd, *rest).transpose(0, 1).reshape(3 * heads * hd, *rest).contiguous()


# ------------------------------------------------------------------------------ HF GPT-2

_HF_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def hf_config_to_model(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """Our `Model:` keys from an HF GPT2Config dict (shapes of non-uniform layers come later)."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise CheckpointError(f"{source}: model_type {hf.get('model_type')!r} is not gpt2; only GPT-2 checkpoints import")
    act = hf.get("activation_function", "gelu_new")
    if act not in _HF_TANH_GELUS:
        raise CheckpointError(f"{source}: activation_function {act!r} is not the tanh GELU this model uses ({', '.join(_HF_TANH_GELUS)})")
    for key, bad in (("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False), ("add_cross_attention", True)):
        if hf.get(key, not bad) == bad:
            raise CheckpointError(f"{source}: {key}={bad} is not supported by the reference architecture")
    h = int(hf.get("n_embd", 768))
    return {
        "vocab_size": int(hf.get("vocab_size", 50257)),
        "vocab_size_divisible_unit": 1,  # keep the checkpoint's vocab exactly
        "hidden_size": h,
        "num_layers": int(hf.get("n_layer", 12)),
        "num_attention_heads": int(hf.get("n_head", 12)),
        "ffn_hidden_size": int(hf.get("n_inner") or 4 * h),
        "max_position_embeddings": int(hf.get("n_positions", 1024)),
        "layer_norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
        "hidden_dropout_prob": float(hf.get("resid_pdrop", 0.1)),
        "attention_probs_dropout_prob": float(hf.get("attn_pdrop", 0.1)),
        "initializer_range": float(hf.get("initializer_range", 0.02)),
    }


def _strip_hf_prefix(name: str) -> str:
    return name[len("transformer."):] if name.startswith("transformer.") else name


def hf_layer_shapes(shapes: dict[str, tuple[int, ...]], head_dim: int) -> tuple[list[int], list[int]]:
    """Per-layer (heads, ffn) read from HF tensor shapes {name: shape}."""
    heads, ffns = {}, {}
    for name, shape in shapes.items():
        m = re.fullmatch(r"(?:transformer\.)?h\.(\d+)\.(attn\.c_attn|mlp\.c_fc)\.weight", name)
        if m:
            i = int(m.group(1))
            if m.group(2) == "attn.c_attn":
                heads[i] = shape[1] // (3 * head_dim)
            else:
                ffns[i] = shape[1]
    n = len(heads)
    return [heads[i] for i in range(n)], [ffns[i] for i in range(n)]


def hf_to_ours(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """HF GPT-2 state dict → our names and [out, in] layout (QKV rows still q|k|v: see
    `regroup_qkv`). The tied lm_head and attention-mask buffers are dropped."""
    sd = {_strip_hf_prefix(k): v for k, v in sd.items()}
    out: dict[str, torch.Tensor] = {}
    try:
        out["wte.weight"] = sd["wte.weight"]
        out["wpe.weight"] = sd["wpe.weight"]
        out["norm.weight"] = sd["ln_f.weight"]
        out["norm.bias"] = sd["ln_f.bias"]
        for i in range(num_layers):
            p, q = f"h.{i}.", f"blocks.{i}."
            out[q + "norm1.weight"] = sd[p + "ln_1.weight"]
            out[q + "norm1.bias"] = sd[p + "ln_1.bias"]
            out[q + "attn.qkv_proj.weight"] = sd[p + "attn.c_attn.weight"].t()  # still q|k|v rows
            out[q + "attn.qkv_proj.bias"] = sd[p + "attn.c_attn.bias"]
            out[q + "attn.out_proj.weight"] = sd[p + "attn.c_proj.weight"].t()
            out[q + "attn.out_proj.bias"] = sd[p + "attn.c_proj.bias"]
            out[q + "norm2.weight"] = sd[p + "ln_2.weight"]
            out[q + "norm2.bias"] = sd[p + "ln_2.bias"]
            out[q + "linear1.weight"] = sd[p + "mlp.c_fc.weight"].t()
            out[q + "linear1.bias"] = sd[p + "mlp.c_fc.bias"]
            out[q + "linear2.weight"] = sd[p + "mlp.c_proj.weight"].t()
            out[q + "linear2.bias"] = sd[p + "mlp.c_proj.bias"]
    except KeyError as e:
        raise CheckpointError(f"HF GPT-2 weights: missing tensor {e.args[0]!r}") from None
    return out


def regroup_qkv(sd: dict[str, torch.Tensor], head_dim: int, to_grouped: bool) -> dict[str, torch.Tensor]:
    """Convert every fused QKV weight/bias between per-head rows (ours) and q|k|v rows (HF)."""
    fn = qkv_to_grouped if to_grouped else qkv_from_grouped
    out = dict(sd)
    for name, t in sd.items():
        if re.fullmatch(r"blocks\.\d+\.attn\.qkv_proj\.(weight|bias)", name):
            heads = t.shape[0] // (3 * head_dim)
            out[name] = fn(t, heads)
    return out


def ours_to_hf(sd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Our state dict (QKV already regrouped to q|k|v rows) → HF GPT2LMHeadModel names."""
    out = {
        "transformer.wte.weight": sd["wte.weight"],
        "transformer.wpe.weight": sd["wpe.weight"],
        "transformer.ln_f.weight": sd["norm.weight"],
        "transformer.ln_f.bias": sd["norm.bias"],
    }
    for i in range(num_layers):
        p, q = f"transformer.h.{i}.", f"blocks.{i}."
        out[p + "ln_1.weight"] = sd[q + "norm1.weight"]
        out[p + "ln_1.bias"] = sd[q + "norm1.bias"]
        out[p + "attn.c_attn.weight"] = sd[q + "attn.qkv_proj.weight"].t().contiguous()
        out[p + "attn.c_attn.bias"] = sd[q + "attn.qkv_proj.bias"]
        out[p + "attn.c_proj.weight"] = sd[q + "attn.out_proj.weight"].t().contiguous()
        out[p + "attn.c_proj.bias"] = sd[q + "attn.out_proj.bias"]
        out[p + "ln_2.weight"] = sd[q + "norm2.weight"]
        out[p + "ln_2.bias"] = sd[q + "norm2.bias"]
        out[p + "mlp.c_fc.weight"] = sd[q + "linear1.weight"].t().contiguous()
        out[p + "mlp.c_fc.bias"] = sd[q + "linear1.bias"]
        out[p + "mlp.c_proj.weight"] = sd[q + "linear2.weight"].t().contiguous()
        out[p + "mlp.c_proj.bias"] = sd[q + "linear2.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def model_to_hf_config(m, eos_token_id: int | None = None) -> dict[str, Any]:
    """An HF GPT2Config dict for a uniform-shaped model config."""
    cfg = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab_size,
        "n_positions": m.max_position_embeddings,
        "n_ctx": m.max_position_embeddings,
        "n_embd": m.hidden_size,
        "n_layer": m.num_layers,
        "n_head": m.num_attention_heads,
        "n_inner": m.ffn_hidden_size,
        "activation_function": "gelu_new",
        "resid_pdrop": m.hidden_dropout_prob,
        "embd_pdrop": m.hidden_dropout_prob,
        "attn_pdrop": m.attention_probs_dropout_prob,
        "layer_norm_epsilon": m.layer_norm_epsilon,
        "initializer_range": m.initializer_range,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if eos_token_id is not None:
        cfg["bos_token_id"] = cfg["eos_token_id"] = int(eos_token_id)
    return cfg


# ------------------------------------------------------------------- PaddleFleetX .pdparams

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),  # protocol 2 stores array bytes as latin-1 strings; a pure function
    ("builtins", "tuple"),
    ("builtins", "list"),
    ("builtins", "dict"),
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays; refuses every other global (no code runs)."""

    def __init__(self, f, source: str):
        super().__init__(f)
        self._source = source

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise CheckpointError(
                f"{self._source}: refuses to load {module}.{name}; a .pdparams file should hold only numpy arrays"
            )
        if module.startswith("numpy.core") and not hasattr(np, "core"):
            module = module.replace("numpy.core", "numpy._core")
        try:
            return getattr(importlib.import_module(module), name)
        except ImportError:  # numpy 1.x has no numpy._core
            return getattr(importlib.import_module(module.replace("numpy._core", "numpy.core")), name)


_PADDLE_META_KEYS = ("StructuredToParameterName@@", "UnpackBigParamInfor@@")


def read_pdparams(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Arrays of a `paddle.save(state_dict)` file, without paddle, executing no pickled code."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, expected a file" if path.is_dir() else "not found"
        raise CheckpointError(f"{path}: .pdparams file {what}")
    try:
        with open(path, "rb") as f:
            obj = _ArrayOnlyUnpickler(f, str(path)).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or not a pickle
        raise CheckpointError(f"{path}: not a readable paddle.save file ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a state dict (mapping), got {type(obj).__name__}")
    big = obj.get("UnpackBigParamInfor@@") or {}
    arrays: dict[str, np.ndarray] = {}
    for key, val in obj.items():
        if key in _PADDLE_META_KEYS:
            continue
        if isinstance(val, tuple) and len(val) == 2 and isinstance(val[1], np.ndarray):
            val = val[1]  # (name, ndarray) pairs written for tensors nested in objects
        if isinstance(val, np.ndarray):
            arrays[key] = val
    # paddle splits arrays that exceed the pickle protocol's size limit into slices.
    for key, info in big.items():
        parts = [arrays.pop(s) for s in info["slices"]]
        arrays[key] = np.concatenate([p.reshape(-1) for p in parts]).reshape(info["OriginShape"])
    return arrays


def _paddle_short(name: str) -> str | None:
    m = re.search(r"(embeddings\..*|decoder\..*)$", name)
    return m.group(1) if m else None


def paddle_shapes(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Model keys readable from .pdparams shapes (not the head count: it is not recorded)."""
    short = {s: a for k, a in arrays.items() if (s := _paddle_short(k))}
    try:
        V, h = short["embeddings.word_embeddings.weight"].shape
        S = short["embeddings.position_embeddings.weight"].shape[0]
    except KeyError as e:
        raise CheckpointError(f".pdparams: missing {e.args[0]!r}; is this a GPT checkpoint?") from None
    layers = sorted({int(m.group(1)) for k in short if (m := re.match(r"decoder\.layers\.(\d+)\.", k))})
    if layers != list(range(len(layers))) or not layers:
        raise CheckpointError(f".pdparams: decoder layer indices are not 0..L-1: {layers[:5]}...")
    ffns = [short[f"decoder.layers.{i}.linear1.weight"].shape[1] for i in layers]
    raw: dict[str, Any] = {"vocab_size": int(V), "vocab_size_divisible_unit": 1, "hidden_size": int(h),
                           "num_layers": len(layers), "max_position_embeddings": int(S)}
    if len(set(ffns)) == 1:
        raw["ffn_hidden_size"] = int(ffns[0])
    else:
        raw["ffn_hidden_size"] = int(max(ffns))
        raw["layer_ffn_sizes"] = [int(f) for f in ffns]
    return raw


def paddle_to_ours(arrays: dict[str, np.ndarray], num_layers: int, head_dim: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(our state dict in fp32, ignored keys). Paddle [in,out] weights are transposed."""
    short = {}
    for k, a in arrays.items():
        s = _paddle_short(k)
        if s is not None:
            short[s] = a
    t = {k: torch.from_numpy(np.ascontiguousarray(a)).float() for k, a in short.items()}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in t:
            raise CheckpointError(f".pdparams: missing tensor {name!r}")
        used.add(name)
        return t[name]

    out = {"wte.weight": take("embeddings.word_embeddings.weight"),
           "wpe.weight": take("embeddings.position_embeddings.weight"),
           "norm.weight": take("decoder.norm.weight"), "norm.bias": take("decoder.norm.bias")}
    for i in range(num_layers):
        p, q = f"decoder.layers.{i}.", f"blocks.{i}."
        if p + "self_attn.qkv_proj.weight" in t:
            out[q + "attn.qkv_proj.weight"] = take(p + "self_attn.qkv_proj.weight").t()
            out[q + "attn.qkv_proj.bias"] = take(p + "self_attn.qkv_proj.bias")
        else:  # unfused q/k/v: interleave into per-head groups
            ws = [take(p + f"self_attn.{n}_proj.weight").t() for n in "qkv"]  # each [heads*hd, h]
            bs = [take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            heads = ws[0].shape[0] // head_dim
            out[q + "attn.qkv_proj.weight"] = torch.stack([w.reshape(heads, head_dim, -1) for w in ws], 1).reshape(3 * heads * head_dim, -1)
            out[q + "attn.qkv_proj.bias"] = torch.stack([b.reshape(heads, head_dim) for b in bs], 1).reshape(-1)
        out[q + "attn.out_proj.weight"] = take(p + "self_attn.out_proj.weight").t()
        out[q + "attn.out_proj.bias"] = take(p + "self_attn.out_proj.bias")
        out[q + "linear1.weight"] = take(p + "linear1.weight").t()
        out[q + "linear1.bias"] = take(p + "linear1.bias")
        out[q + "linear2.weight"] = take(p + "linear2.weight").t()
        out[q + "linear2.bias"] = take(p + "linear2.bias")
        for n in ("norm1", "norm2"):
            out[q + f"{n}.weight"] = take(p + f"{n}.weight")
            out[q + f"{n}.bias"] = take(p + f"{n}.bias")
    ignored = sorted(set(t) - used)
    return {k: v.contiguous() for k, v in out.items()}, ignored


def paddle_layer_heads(arrays: dict[str, np.ndarray], num_layers: int, head_dim: int) -> list[int]:
    short = {s: a for k, a in arrays.items() if (s := _paddle_short(k))}
    heads = []
    for i in range(num_layers):
        p = f"decoder.layers.{i}.self_attn."
        if p + "qkv_proj.weight" in short:
            heads.append(short[p + "qkv_proj.weight"].shape[1] // (3 * head_dim))
        else:
            heads.append(short[p + "q_proj.weight"].shape[1] // head_dim)
    return heads


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
