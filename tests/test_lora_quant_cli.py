"""LoRA / DoRA adapters over quantized bases (INT8, QAT), the verbs (merge, export --adapter,
generate/eval --adapter) and training under autocast."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from gptforge.adapters import (
    apply_lora,
    count_parameters,
    merge_adapters,
    trainable_parameters,
)
from gptforge.config.schema import LoraConfig
from lora_support import (
    IDS,
    _adapter_pair,
    _int8_reference,
    _model,
    _ours,
    _quantized,
    _randomize,
    _steps,
    _theirs,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ----------------------------------------------------------------------- quantized bases


@pytest.mark.parametrize("dora", [False, True])
def test_lora_over_int8_is_the_int8_output_plus_a_float_delta(dora):
    _, m = _quantized()
    apply_lora(m, LoraConfig(r=4, alpha=8, dora=dora, targets=["q", "v", "linear1"]))
    n, total = count_parameters(m)
    assert total > sum(p.numel() for p in m.parameters())  # the int8 weights count
    _randomize(m)
    for layer, name in ((m.blocks[0].linear1, "full"), (m.blocks[1].attn.qkv_proj, "v")):
        base, pair = layer.base, layer.adapters[name]
        x = torch.randn(2, 7, 64, requires_grad=True)
        y_base = _int8_reference(base, x)
        w = base.dequantized_weight()
        rows = layer.slice_rows(y_base, name) if name == "full" else \
            y_base.reshape(2, 7, -1, 3, 16)[..., 2, :].reshape(2, 7, -1)
        delta = pair.scaling * (x @ pair.lora_A.T @ pair.lora_B.T)
        if dora:
            scale = pair.magnitude / torch.linalg.norm(layer.slice_rows(w, name) + pair.delta_weight(), dim=1)
            b = layer.slice_rows(base.bias, name)
            want_rows = rows + (scale - 1) * (rows - b) + scale * delta
        else:
            want_rows = rows + delta
        got = layer(x)
        got_rows = got if name == "full" else got.reshape(2, 7, -1, 3, 16)[..., 2, :].reshape(2, 7, -1)
        torch.testing.assert_close(got_rows, want_rows, atol=1e-5, rtol=1e-5)
        # The INT8 kernel has no gradient; the input gets the fake-quant twin's (straight-through).
        g = torch.randn_like(got_rows)
        (gx,) = torch.autograd.grad((got_rows * g).sum(), x)
        (gref,) = torch.autograd.grad((want_rows * g).sum(), x)
        assert gx.abs().max() > 0
        torch.testing.assert_close(gx, gref, atol=1e-5, rtol=1e-5)


def test_lora_over_a_qat_base_adds_to_the_fake_quant_output():
    qat, _ = _quantized()
    lin = copy.deepcopy(qat.blocks[0].attn.out_proj)
    apply_lora(qat, LoraConfig(r=4, targets=["out_proj"]))
    _randomize(qat)
    layer = qat.blocks[0].attn.out_proj
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), lin(x) + layer.adapters["full"].scaling * (
            x @ layer.adapters["full"].lora_A.T @ layer.adapters["full"].lora_B.T), atol=1e-5, rtol=0)
    scales = {k: v.clone() for k, v in layer.state_dict().items() if "act_" in k}
    _steps(qat, torch.optim.SGD([p for _, p in trainable_parameters(qat)], lr=0.1), 1)
    assert layer.adapters["full"].training and not layer.base.training
    assert scales and all(torch.equal(v, layer.state_dict()[k]) for k, v in scales.items())  # frozen base


def test_merging_into_int8_requantizes_the_float_sum():
    _, m = _quantized()
    apply_lora(m, LoraConfig(r=4, alpha=8, targets=["linear1"]))
    _randomize(m, scale=0.5)
    layer = m.blocks[0].linear1
    want = layer.base.dequantized_weight() + layer.adapters["full"].delta_weight().detach()
    ints_before = layer.base.weight.clone()
    merge_adapters(m)
    merge_adapters(m)  # idempotent
    step = layer.base.weight_scale[:, None]
    got = layer.base.dequantized_weight()
    assert layer.base.weight.dtype == torch.int8 and not torch.equal(layer.base.weight, ints_before)
    assert torch.all((got - want).abs() <= step / 2 + 1e-6)  # one rounding of W_dq + ΔW on a fresh grid
    torch.testing.assert_close(step.squeeze(1), want.abs().amax(1) / 127)


# ------------------------------------------------------------------------------- the CLI


def test_export_and_merge_verbs_merge_once(tmp_path, run_cli):
    from gptforge.model_io import load_model

    base, cfg = _model()
    m = _adapter_pair(tmp_path, base, cfg, dora=True)
    want = _ours(m)
    code, out, err = run_cli("export", "--format", "hf", "--ckpt", tmp_path / "base", "--adapter",
                             tmp_path / "adapter", "--out", tmp_path / "hf")
    assert code == 0, err
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    torch.testing.assert_close(_theirs(hf), want, atol=1e-5, rtol=0)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["gptforge_merged_adapters"][0]["sha256"]

    code, out, err = run_cli("merge", "--ckpt", tmp_path / "base", "--adapter", tmp_path / "adapter",
                             "--out", tmp_path / "merged")
    assert code == 0, err
    assert "adapter merged" in out
    merged, _ = load_model(tmp_path / "merged")
    torch.testing.assert_close(_ours(merged), want, atol=1e-5, rtol=0)
    code, out, err = run_cli("merge", "--ckpt", tmp_path / "hf", "--adapter", tmp_path / "adapter",
                             "--out", tmp_path / "hf2", "--format", "hf")  # the export recorded the merge
    assert code == 0 and "weights unchanged" in out, err
    hf2 = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf2")).eval()
    torch.testing.assert_close(_theirs(hf2), want, atol=1e-5, rtol=0)
    code, out, err = run_cli("merge", "--ckpt", tmp_path / "merged", "--adapter", tmp_path / "adapter",
                             "--out", tmp_path / "twice")
    assert code == 0 and "weights unchanged" in out, err
    again, _ = load_model(tmp_path / "twice")
    for k, v in merged.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    code, out, err = run_cli("merge", "--ckpt", tmp_path / "base", "--adapter", tmp_path / "nope", "--out",
                             tmp_path / "x")
    assert code == 2 and "not a PEFT adapter directory" in err and len(err.strip().splitlines()) == 1


def test_merge_into_an_int8_base_requantizes_and_reports(tmp_path, run_cli):
    from gptforge.config.schema import QuantizationConfig
    from gptforge.model_io import load_model
    from gptforge.transforms.int8 import converted_config

    _, int8 = _quantized()
    _, cfg = _model()
    cfg.Compress.Quantization = converted_config(QuantizationConfig(enable=True), False, [])
    m = _adapter_pair(tmp_path, int8, cfg, scale=0.02)  # deltas of about the size of the weights
    code, out, err = run_cli("merge", "--ckpt", tmp_path / "base", "--adapter", tmp_path / "adapter",
                             "--out", tmp_path / "merged")
    assert code == 0, err
    assert "re-quantized" in out and "argmax agreement" in out
    merged, _ = load_model(tmp_path / "merged")
    assert merged.blocks[0].linear1.weight.dtype == torch.int8
    want, got = _ours(m), _ours(merged)
    effect = (want - _ours(int8)).abs().max()
    assert effect > 0.02 and (got - want).abs().max() < 0.25 * effect  # one weight re-quantization away


def test_generate_and_eval_load_an_adapter_over_the_checkpoint(tmp_path, run_cli):
    import argparse

    from gptforge.commands.common import load_model_and_tokenizer
    from gptforge.config import load_config

    base, cfg = _model()
    m = _adapter_pair(tmp_path, base, cfg)
    args = argparse.Namespace(ckpt=str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
    loaded, _, _ = load_model_and_tokenizer(args, load_config(), device="cpu")
    assert not loaded.training
    torch.testing.assert_close(_ours(loaded), _ours(m), atol=1e-6, rtol=0)
    code, out, err = run_cli("generate", "--ckpt", tmp_path / "base", "--adapter", tmp_path / "adapter",
                             "--prompt", "a", "-o", "Generation.max_dec_len=3",
                             "-o", "Generation.decode_strategy=greedy_search", "--json", tmp_path / "g.json")
    assert code == 0, err
    got = json.loads((tmp_path / "g.json").read_text())["results"][0]["completions"][0]["token_ids"]
    want = torch.tensor([[64]])  # "a"
    with torch.no_grad():
        for _ in range(3):
            want = torch.cat([want, m(want).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert got == want[0, 1:].tolist()  # greedy with the adapter on
    code, _, err = run_cli("generate", "--ckpt", tmp_path / "base", "--adapter", tmp_path / "missing", "--prompt", "a")
    assert code == 2 and "adapter directory not found" in err


@pytest.mark.parametrize("dora", [False, True])
def test_a_head_adapter_over_an_int8_embedding_adds_to_its_projection(dora):
    from gptforge.transforms.int8 import Int8Embedding, convert_model

    qat, _ = _quantized()
    convert_model(qat, int8_embedding=True)
    emb = qat.wte
    assert isinstance(emb, Int8Embedding)
    apply_lora(qat, LoraConfig(r=4, targets=["head"], dora=dora))
    _randomize(qat)
    pair = qat.wte.pair
    h = torch.randn(2, 3, 64)
    with torch.no_grad():
        y = emb.project(h)
        delta = pair.scaling * (h @ pair.lora_A.T @ pair.lora_B.T)
        if dora:
            scale = pair.magnitude / torch.linalg.norm(emb.dequantized_weight() + pair.delta_weight(), dim=1)
            want = y + (scale - 1) * y + scale * delta
        else:
            want = y + delta
        torch.testing.assert_close(qat.logits(h), want, atol=1e-5, rtol=1e-5)
        assert torch.equal(qat.wte(IDS), emb(IDS))  # lookups are the embedding's own
        assert qat(IDS).logits.shape == (2, 11, 512)


def test_every_adapter_gets_a_gradient_under_bf16_autocast():
    m, _ = _model()
    apply_lora(m, LoraConfig(dora=True, dropout=0.1, targets=["all", "head"]))
    _randomize(m, 0.02)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m.train()(IDS[:, :-1], labels=IDS[:, 1:])
    out.loss.backward()
    grads = [p.grad for _, p in trainable_parameters(m)]
    assert len(grads) == 8 * 3 + 3 and all(g is not None and g.abs().sum() > 0 for g in grads)
    assert not any(p.grad is not None for n, p in m.named_parameters() if not p.requires_grad)

