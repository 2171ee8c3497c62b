"""`gptforge export --format hf`: transformers loads dense, pruned, QAT and INT8 exports offline
with our logits; sharding; the generation config; the CLI and its errors."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

from gptforge.export import save_hf
from gptforge.transforms.quant import set_quant_enabled
from test_export_support import peaky_model, pruned_model, qat_model, save
from test_train_support import small_tokenizer

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")


def _hf_logits(path, ids):
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    with torch.no_grad():
        return hf(ids).logits


def _ids(n=2, t=17, seed=1):
    return torch.randint(0, 300, (n, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_dense_cli_export_loads_in_transformers(run_cli, tmp_path):
    model, cfg = peaky_model("Generation.decode_strategy=greedy_search", "Generation.max_dec_len=7")
    src = save(model, cfg, tmp_path / "model")
    code, out, err = run_cli("export", "--format", "hf", "--ckpt", src, "--out", tmp_path / "hf")
    assert code == 0, err
    assert "1 weight file(s), n_head 4, n_inner 256" in out
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "vocab.json",
            "merges.txt", "tokenizer_config.json"} <= set(names)
    ids = _ids()
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", ids), model(ids).logits, rtol=1e-5, atol=1e-5)

    # the tokenizer loads in transformers and encodes as ours
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "the quick brown fox, judge my vow"
    assert hf_tok(text)["input_ids"] == small_tokenizer().encode(text)

    # generation_config.json carries Generation: HF's default generate() = our greedy output
    from gptforge.generate import generate_ids

    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["do_sample"] is False and gen["max_new_tokens"] == 7 and gen["eos_token_id"] == 299
    assert gen["suppress_tokens"][0] == 300 and len(gen["suppress_tokens"]) == 4096 - 300  # padded vocabulary
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    prompt = small_tokenizer().encode("pack my box with")
    hf_out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    ours = generate_ids(model, [prompt], cfg.Generation, eos_token_id=299, vocab_limit=300).sequences(keep_eos=True)
    assert hf_out[0, len(prompt):].tolist() == ours[0]


@torch.no_grad()
def test_uniformly_pruned_model_keeps_its_ffn_width_and_pads_heads(tmp_path):
    from gptforge.config.schema import PruneConfig
    from gptforge.transforms.prune import prune_model

    model, cfg = peaky_model()
    prune_model(model, PruneConfig(enable=True, ratio=0.25, scope="uniform"))
    assert model.config.num_attention_heads == 3 and model.config.ffn_hidden_size == 192
    r = save_hf(model, tmp_path / "hf", small_tokenizer(), model_cfg=cfg.Model)
    assert (r.n_head, r.n_inner, r.zero_padded) == (4, 192, True)  # 3 heads + a zero head of 16: GPT-2's n_embd/n_head
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["gptforge_pruned_shape"]["layer_num_heads"] == [3, 3] and hf_cfg["n_inner"] == 192
    ids = _ids()
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", ids), model(ids).logits, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_qat_and_int8_models_export_their_folded_weights(tmp_path):
    from gptforge.transforms.int8 import convert_model

    fq, cfg = qat_model("Compress.Quantization.quantize_embedding=true")
    int8 = copy.deepcopy(fq)
    convert_model(int8)
    ids = _ids()
    weights_only = copy.deepcopy(fq)
    set_quant_enabled(weights_only, act=False)  # what an HF model can compute: no activation quantization
    want = weights_only(ids).logits
    assert (want - fq(ids).logits).abs().max() > 1e-3  # activation quantization does matter here
    for name, m in (("qat", fq), ("int8", int8)):
        r = save_hf(m, tmp_path / name, small_tokenizer(), generation=cfg.Generation)
        assert r.source_kind == ("fake-quant" if name == "qat" else "int8")
        torch.testing.assert_close(_hf_logits(tmp_path / name, ids), want, rtol=1e-5, atol=1e-5)
        note = json.loads((tmp_path / name / "config.json").read_text())["gptforge_quantization"]
        scale = float(fq.blocks[1].attn.qkv_proj.act_scale)
        assert note["activation_abs_max"]["blocks.1.attn.qkv_proj"] == pytest.approx(scale, rel=1e-6)
        assert note["pact_alpha"]["blocks.0.linear2"] == pytest.approx(float(fq.blocks[0].linear2.pact_alpha))


@torch.no_grad()
def test_sharded_export_has_an_index_and_loads(tmp_path):
    from safetensors import safe_open

    from gptforge.model_io import load_model

    model, _ = pruned_model()  # per-layer shapes: zero-padded into GPT-2's uniform shape
    r = save_hf(model, tmp_path / "hf", small_tokenizer(), max_shard_size="300KB")
    shards = [f for f in r.files if f.endswith(".safetensors")]
    assert len(shards) > 2 and not (tmp_path / "hf" / "model.safetensors").exists()
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:  # every shard within the limit unless it holds one larger tensor
        with safe_open(str(tmp_path / "hf" / shard), "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118
        assert len(sizes) == 1 or sum(4 * torch.Size(s).numel() for s in sizes) <= 300_000
    ids = _ids()
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", ids), model(ids).logits, rtol=1e-5, atol=1e-5)
    back, _ = load_model(tmp_path / "hf")  # and our loader reads the shards back
    torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, cfg = peaky_model()
    return save(model, cfg, tmp_path_factory.mktemp("export_cli") / "model")


def _one_line_error(code, err, *needles):
    assert code == 2, err
    assert err.startswith("gptforge export: error:") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err


def test_cli_errors(run_cli, model_dir, tmp_path, monkeypatch):
    code, _, err = run_cli("export", "--format", "onnx", "--ckpt", tmp_path / "missing", "--out", tmp_path / "o")
    _one_line_error(code, err, "missing", "not found")
    code, _, err = run_cli("export", "--format", "tflite", "--ckpt", model_dir, "--out", tmp_path / "o")
    _one_line_error(code, err, "tflite", "hf, onnx, torch")
    code, _, err = run_cli("export", "--format", "onnx", "--ckpt", model_dir, "--out", tmp_path / "o",
                           "--precision", "int8")
    _one_line_error(code, err, "--precision int8 needs a quantized checkpoint")
    code, _, err = run_cli("export", "--format", "hf", "--ckpt", model_dir, "--out", tmp_path / "o",
                           "--max-shard-size", "lots")
    _one_line_error(code, err, "--max-shard-size 'lots'")
    code, _, err = run_cli("export", "--format", "torch", "--ckpt", model_dir, "--out", tmp_path / "o",
                           "--max-shard-size", "1GB")
    _one_line_error(code, err, "applies to --format hf")
    assert not (tmp_path / "o").exists()

    # an existing output directory is refused unless --force
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("x")
    code, _, err = run_cli("export", "--format", "hf", "--ckpt", model_dir, "--out", tmp_path / "taken")
    _one_line_error(code, err, "already exists", "--force")
    assert (tmp_path / "taken" / "keep.txt").exists()
    code, _, err = run_cli("export", "--format", "hf", "--ckpt", model_dir, "--out", tmp_path / "taken", "--force")
    assert code == 0, err
    assert not (tmp_path / "taken" / "keep.txt").exists() and (tmp_path / "taken" / "config.json").exists()

    # the onnx extra missing: named, with the install command, before the model loads
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    code, _, err = run_cli("export", "--format", "onnx", "--ckpt", model_dir, "--out", tmp_path / "o")
    _one_line_error(code, err, "onnxscript", "pip install 'gptforge[export]'")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    code, _, err = run_cli("infer", "--onnx", tmp_path / "o", "--prompt", "x")
    assert code == 2 and "needs onnxruntime" in err and err.count("\n") == 1, err
