"""HF GPT-2 parity: import randomly initialised transformers models, export ours back."""

from __future__ import annotations

import pytest
import torch

from gf_testutil import tiny_model
from gptforge.model_io import load_model, save_hf_dir, save_model_dir

transformers = pytest.importorskip("transformers")

SHAPES = [
    dict(n_embd=64, n_head=4, n_layer=2, n_inner=None),
    dict(n_embd=60, n_head=5, n_layer=3, n_inner=None),  # odd head count, head_dim 12
    dict(n_embd=48, n_head=3, n_layer=2, n_inner=100),  # odd heads and a non-4h FFN
]


def _hf_model(tmp_path, safe: bool = True, **shape):
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=257, n_positions=48, bos_token_id=0, eos_token_id=0, **shape)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-zero biases and LayerNorm params so every mapping is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "hf", safe_serialization=safe)
    return model


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s['n_embd']}x{s['n_head']}")
def test_import_hf_logits_and_loss(tmp_path, shape):
    hf = _hf_model(tmp_path, **shape)
    ours, cfg = load_model(tmp_path / "hf")
    assert cfg.Model.vocab_size == 257  # imported vocab is not padded
    x = torch.randint(0, 257, (3, 21))
    with torch.no_grad():
        ref = hf(x, labels=x)
        out = ours(x[:, :-1], labels=x[:, 1:])
    assert (ref.logits[:, :-1] - out.logits).abs().max() < 1e-4
    assert abs(ref.loss.item() - out.loss.item()) < 1e-5


def test_import_hf_pytorch_bin(tmp_path):
    hf = _hf_model(tmp_path, safe=False, **SHAPES[0])
    ours, _ = load_model(tmp_path / "hf")
    x = torch.randint(0, 257, (2, 9))
    with torch.no_grad():
        assert (hf(x).logits - ours(x).logits).abs().max() < 1e-4


@pytest.mark.parametrize("heads", [4, 2])
def test_export_reload_in_transformers(tmp_path, heads):
    ours, cfg = tiny_model(f"Model.num_attention_heads={heads}")
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    save_hf_dir(ours, cfg, tmp_path / "out")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, cfg.Model.vocab_size, (2, 13))
    with torch.no_grad():
        ref = hf(x, labels=x)
        out = ours(x[:, :-1], labels=x[:, 1:])
    assert (ref.logits[:, :-1] - out.logits).abs().max() < 1e-4
    assert abs(ref.loss.item() - out.loss.item()) < 1e-5


def test_roundtrip_hf_ours_hf_via_cli(tmp_path, run_cli):
    hf = _hf_model(tmp_path, **SHAPES[1])
    code, out, err = run_cli("convert", "--src", tmp_path / "hf", "--out", tmp_path / "ours")
    assert code == 0, err
    code, out, err = run_cli("convert", "--src", tmp_path / "ours", "--out", tmp_path / "back", "--to", "hf")
    assert code == 0, err
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    x = torch.randint(0, 257, (2, 11))
    with torch.no_grad():
        assert (hf(x).logits - back(x).logits).abs().max() < 1e-5
    # Refuses to overwrite without --force.
    code, _, err = run_cli("convert", "--src", tmp_path / "ours", "--out", tmp_path / "back", "--to", "hf")
    assert code == 2 and "already exists" in err


def test_our_directory_roundtrip_is_exact(tmp_path):
    ours, cfg = tiny_model()
    save_model_dir(ours, cfg, tmp_path / "m")
    again, cfg2 = load_model(tmp_path / "m")
    for (n, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert cfg2.Model == cfg.Model
