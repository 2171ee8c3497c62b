"""PaddleFleetX `.pdparams` import without paddle.

`write_pdparams` documents the on-disk format (spec §1.9): `paddle.save(state_dict)` pickles a
plain dict mapping each structured parameter name to a numpy array, plus one entry
'StructuredToParameterName@@' mapping each structured name to Paddle's automatic name
(`linear_0.w_0`, ...). Linear weights are [in, out]; a fused qkv weight [h, 3h] has its output
columns grouped per head: [q_h0 k_h0 v_h0 q_h1 ...], each head_dim wide.

The expected logits come from `paddle_forward`, a direct re-statement of the reference
architecture on the Paddle-layout arrays, independent of our importer.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gptforge.errors import CheckpointError, ConfigError
from gptforge.model_io import load_model, load_run_config

V, S, H, NH, L, FFN = 300, 40, 64, 4, 3, 256  # not a preset shape: heads must be given


def paddle_arrays(rng: np.random.Generator, fused: bool = True, dtype=np.float32, heads=NH) -> dict[str, np.ndarray]:
    hd = H // NH
    a = {"gpt.embeddings.word_embeddings.weight": rng.normal(0, 0.02, (V, H)),
         "gpt.embeddings.position_embeddings.weight": rng.normal(0, 0.02, (S, H)),
         "gpt.decoder.norm.weight": 1 + rng.normal(0, 0.1, H), "gpt.decoder.norm.bias": rng.normal(0, 0.1, H)}
    for i in range(L):
        p = f"gpt.decoder.layers.{i}."
        if fused:
            a[p + "self_attn.qkv_proj.weight"] = rng.normal(0, 0.02, (H, 3 * heads * hd))
            a[p + "self_attn.qkv_proj.bias"] = rng.normal(0, 0.1, 3 * heads * hd)
        else:
            for n in "qkv":
                a[p + f"self_attn.{n}_proj.weight"] = rng.normal(0, 0.02, (H, heads * hd))
                a[p + f"self_attn.{n}_proj.bias"] = rng.normal(0, 0.1, heads * hd)
        a[p + "self_attn.out_proj.weight"] = rng.normal(0, 0.02, (heads * hd, H))
        a[p + "self_attn.out_proj.bias"] = rng.normal(0, 0.1, H)
        a[p + "linear1.weight"] = rng.normal(0, 0.02, (H, FFN))
        a[p + "linear1.bias"] = rng.normal(0, 0.1, FFN)
        a[p + "linear2.weight"] = rng.normal(0, 0.02, (FFN, H))
        a[p + "linear2.bias"] = rng.normal(0, 0.1, H)
        for n in ("norm1", "norm2"):
            a[p + f"{n}.weight"] = 1 + rng.normal(0, 0.1, H)
            a[p + f"{n}.bias"] = rng.normal(0, 0.1, H)
    return {k: v.astype(dtype) for k, v in a.items()}


def write_pdparams(path, arrays: dict[str, np.ndarray], protocol: int = 4) -> None:
    """Write `arrays` the way `paddle.save(model.state_dict(), path)` does."""
    obj = dict(arrays)
    obj["StructuredToParameterName@@"] = {k: f"param_{i}.w_0" for i, k in enumerate(arrays)}
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)


def paddle_forward(a: dict[str, np.ndarray], ids: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """Reference forward on Paddle-layout weights: pre-LN GPT, x @ W[in,out] + b, tied head."""
    t = {k: torch.tensor(v, dtype=torch.float32) for k, v in a.items()}
    hd = H // NH
    B, T = ids.shape
    x = t["gpt.embeddings.word_embeddings.weight"][ids] + t["gpt.embeddings.position_embeddings.weight"][:T]
    causal = torch.ones(T, T).tril().bool()
    for i in range(L):
        p = f"gpt.decoder.layers.{i}."
        y = F.layer_norm(x, (H,), t[p + "norm1.weight"], t[p + "norm1.bias"], 1e-5)
        if fused:
            qkv = (y @ t[p + "self_attn.qkv_proj.weight"] + t[p + "self_attn.qkv_proj.bias"]).reshape(B, T, -1, 3 * hd)
            q, k, v = qkv.split(hd, dim=-1)
        else:
            q, k, v = ((y @ t[p + f"self_attn.{n}_proj.weight"] + t[p + f"self_attn.{n}_proj.bias"]).reshape(B, T, -1, hd)
                       for n in "qkv")
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / hd**0.5
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        att = att.transpose(1, 2).reshape(B, T, -1)
        x = x + att @ t[p + "self_attn.out_proj.weight"] + t[p + "self_attn.out_proj.bias"]
        y = F.layer_norm(x, (H,), t[p + "norm2.weight"], t[p + "norm2.bias"], 1e-5)
        y = F.gelu(y @ t[p + "linear1.weight"] + t[p + "linear1.bias"], approximate="tanh")
        x = x + y @ t[p + "linear2.weight"] + t[p + "linear2.bias"]
    x = F.layer_norm(x, (H,), t["gpt.decoder.norm.weight"], t["gpt.decoder.norm.bias"], 1e-5)
    return x @ t["gpt.embeddings.word_embeddings.weight"].T


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("protocol", [2, 4])
def test_pdparams_import_matches_reference_forward(tmp_path, fused, protocol):
    arrays = paddle_arrays(np.random.default_rng(0), fused=fused)
    write_pdparams(tmp_path / "model.pdparams", arrays, protocol)
    cfg = load_run_config(overrides=[f"Model.num_attention_heads={NH}"], ckpt_dir=tmp_path)
    model, cfg = load_model(tmp_path, cfg)
    assert (cfg.Model.vocab_size, cfg.Model.hidden_size, cfg.Model.num_layers, cfg.Model.ffn_hidden_size) == (V, H, L, FFN)
    ids = torch.randint(0, V, (2, 17))
    with torch.no_grad():
        assert (model(ids).logits - paddle_forward(arrays, ids, fused)).abs().max() < 1e-4


def test_fp16_pdparams_and_ignored_keys(tmp_path, capsys):
    arrays = paddle_arrays(np.random.default_rng(1), dtype=np.float16)
    arrays["gpt.decoder.layers.0.linear1.weight_backup"] = np.zeros((H, FFN), np.float16)
    write_pdparams(tmp_path / "model.pdparams", arrays)
    model, _ = load_model(tmp_path, load_run_config(overrides=[f"Model.num_attention_heads={NH}"], ckpt_dir=tmp_path))
    assert model.wte.weight.dtype == torch.float32
    assert "ignored 1 non-model tensors" in capsys.readouterr().err
    ids = torch.randint(0, V, (1, 9))
    ref = paddle_forward({k: v.astype(np.float32) for k, v in arrays.items()}, ids)
    with torch.no_grad():
        assert (model(ids).logits - ref).abs().max() < 1e-4


def test_fewer_heads_per_layer_import(tmp_path):
    """Checkpoints whose qkv has fewer heads than the nominal count (e.g. head-reduced)."""
    arrays = paddle_arrays(np.random.default_rng(2), heads=3)
    write_pdparams(tmp_path / "model.pdparams", arrays)
    model, cfg = load_model(tmp_path, load_run_config(overrides=[f"Model.num_attention_heads={NH}"], ckpt_dir=tmp_path))
    assert cfg.Model.head_dim == H // NH
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        assert (model(ids).logits - paddle_forward(arrays, ids)).abs().max() < 1e-4


def test_head_count_must_be_given_for_unknown_shapes(tmp_path, run_cli):
    write_pdparams(tmp_path / "model.pdparams", paddle_arrays(np.random.default_rng(3)))
    with pytest.raises(ConfigError, match="Model.num_attention_heads"):
        load_run_config(ckpt_dir=tmp_path)
    code, _, err = run_cli("convert", "--src", tmp_path / "model.pdparams", "--out", tmp_path / "o")
    assert code == 2 and "-o Model.num_attention_heads=N" in err
    code, out, err = run_cli("convert", "--src", tmp_path / "model.pdparams", "--out", tmp_path / "o",
                             "-o", f"Model.num_attention_heads={NH}")
    assert code == 0, err


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_unpickler_refuses_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "model.pdparams", "wb") as f:
        pickle.dump({"gpt.embeddings.word_embeddings.weight": _Evil()}, f)
    with pytest.raises(CheckpointError, match="refuses to load"):
        load_model(tmp_path, load_run_config(overrides=["Model.num_attention_heads=4"], ckpt_dir=None))
    assert not (tmp_path / "PWNED").exists()


def test_truncated_pdparams_is_a_clear_error(tmp_path):
    write_pdparams(tmp_path / "model.pdparams", paddle_arrays(np.random.default_rng(4)))
    data = (tmp_path / "model.pdparams").read_bytes()
    (tmp_path / "model.pdparams").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable paddle.save file"):
        load_model(tmp_path)


def test_real_paddle_save_if_installed(tmp_path):
    paddle = pytest.importorskip("paddle")
    arrays = paddle_arrays(np.random.default_rng(5))
    paddle.save({k: paddle.to_tensor(v) for k, v in arrays.items()}, str(tmp_path / "model.pdparams"))
    model, _ = load_model(tmp_path, load_run_config(overrides=[f"Model.num_attention_heads={NH}"], ckpt_dir=tmp_path))
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        assert (model(ids).logits - paddle_forward(arrays, ids)).abs().max() < 1e-4
