"""4-bit weight-only QAT (`Compress.Quantization.weight_only`): the fake quant is round-to-nearest's
grid exactly, its gradient is the straight-through estimator, and `gptforge quantize --weights
int4` of a QAT checkpoint computes the fake-quant model's logits; user errors name the key."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from gptforge.config.schema import QuantizationConfig
from gptforge.errors import ConfigError
from gptforge.transforms import lowbit
from gptforge.transforms.quant import quantize_model, validate_config
from gptforge.transforms.weight_only import KERNEL_ENV, WeightOnlyLinear, read_spec
from gptforge.transforms.weight_qat import WeightQuantEmbedding, WeightQuantLinear

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (4, 32, False), (4, 0, True), (8, 64, False),
                                            (8, 0, True), (16, 0, True)])
def test_fake_quant_is_the_weight_only_formats_grid_exactly(bits, group, sym):
    w = torch.randn(24, 128) * torch.rand(24, 1) * 3
    w[3, :32] = 0.0  # an all-zero group
    w[5, 7] = 40.0  # an outlier that sets its group's scale
    fq = lowbit.fake_quantize(w, bits, group, sym)
    stored = WeightOnlyLinear.from_float(w, None, bits, group, sym).dequantized_weight()
    assert torch.equal(fq, stored)  # the numbers the weight-only layer computes with, bit for bit
    if bits < 16:
        q, scale, zero = lowbit.quantize_rtn(w, bits, group, sym)
        assert torch.equal(fq, lowbit.dequantize(q, scale, zero, group))
        lo, hi = lowbit.qrange(bits)
        assert q.min() >= lo and q.max() <= hi and len(fq.unique()) > 2 ** bits  # several groups' grids


def test_gradient_is_straight_through():
    """A weight-only QAT model's forward and gradients are those of a float model holding the
    fake-quantized weights (STE: d loss / d W = d loss / d fq(W)), lookup and tied head included."""
    from gf_testutil import tiny_model

    model, cfg = tiny_model()
    ref, _ = tiny_model()
    q = QuantizationConfig(enable=True, weight_only=True, weight_bits=4, group_size=32, head_bits=4)
    quantize_model(model, q)
    assert isinstance(model.blocks[1].attn.qkv_proj, WeightQuantLinear) and isinstance(model.wte, WeightQuantEmbedding)
    with torch.no_grad():
        for (name, p), (rname, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            assert name == rname
            mod = model.get_submodule(name.rpartition(".")[0])
            quantized = isinstance(mod, (WeightQuantLinear, WeightQuantEmbedding)) and name.endswith("weight")
            rp.copy_(lowbit.fake_quantize(p, 4, 32, True) if quantized else p)
    model.train()
    ref.train()
    ids = torch.randint(0, cfg.Model.vocab_size, (2, 24))
    out, rout = model(ids, labels=ids), ref(ids, labels=ids)
    assert torch.equal(out.logits, rout.logits)
    out.loss.backward()
    rout.loss.backward()
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, rp.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("key,value,needle", [
    ("group_size", 48, "Compress.Quantization.group_size"),
    ("head_bits", 3, "Compress.Quantization.head_bits"),
    ("weight_bits", 3, "Compress.Quantization.weight_bits"),
    ("activation_preprocess_type", "PACT", "Compress.Quantization.activation_preprocess_type"),
    ("quantize_embedding", True, "Compress.Quantization.quantize_embedding"),
    ("skip_layers", ["blocks.0.linear1"], "Compress.Quantization.skip_layers"),
])
def test_config_errors_name_the_key(key, value, needle):
    q = dataclasses.replace(QuantizationConfig(enable=True, weight_only=True, weight_bits=4), **{key: value})
    with pytest.raises(ConfigError, match=needle):
        validate_config(q, 2)


def test_group_size_must_divide_the_layers():
    from gf_testutil import tiny_model

    model, _ = tiny_model()  # hidden 64
    with pytest.raises(ConfigError, match="Compress.Quantization.group_size: blocks.0.attn.qkv_proj has 64"):
        quantize_model(model, QuantizationConfig(enable=True, weight_only=True, weight_bits=4, group_size=128))


# ------------------------------------------------------------------- the CLI, end to end


@pytest.fixture(scope="module")
def float_run(tmp_path_factory):
    from gptforge.train import pretrain
    from test_train_support import small_tokenizer, train_config

    root = tmp_path_factory.mktemp("qat4")
    cfg = train_config(root, "Engine.save_load.save_steps=-1", "Engine.eval_freq=100", steps=8)
    pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    return root / "out" / "step_8"


def _qat(run_cli, src, out, *keys):
    opts = [a for k in ("weight_only=true", "weight_bits=4", "group_size=32", *keys)
            for a in ("-o", f"Compress.Quantization.{k}")]
    return run_cli("qat", "--ckpt", src, "-o", f"Engine.save_load.output_dir={out}", "-o", "Engine.max_steps=3",
                   "-o", "Engine.save_load.save_steps=3", "-o", "Engine.eval_freq=100", "-o",
                   "Optimizer.lr.max_lr=1e-2", "--no-progress", *opts)


@pytest.mark.parametrize("keys", [("head_bits=4",), ("weight_sym=false", "head_bits=8")])
def test_qat_checkpoint_converts_to_a_weight_only_model_with_its_logits(run_cli, float_run, tmp_path, monkeypatch,
                                                                        keys):
    from gf_testutil import assert_close_for_kernels, chosen_kernels
    from gptforge.model_io import load_model

    code, _, err = _qat(run_cli, float_run, tmp_path / "qat", *keys)
    assert code == 0, err
    step = tmp_path / "qat" / "step_3"
    sd, fsd = load_file(str(step / "model.safetensors")), load_file(str(float_run / "model.safetensors"))
    assert set(sd) == set(fsd)  # the float master weights, nothing else
    assert not torch.equal(sd["blocks.0.linear1.weight"], fsd["blocks.0.linear1.weight"])  # trained
    fq, _ = load_model(step)
    assert isinstance(fq.blocks[0].linear2, WeightQuantLinear)

    out = tmp_path / "int4"
    code, stdout, err = run_cli("quantize", "--ckpt", step, "--out", out, "--weights", "int4")  # grid from the QAT
    assert code == 0, err
    head = 4 if "head_bits=4" in keys else 8
    sym = "weight_sym=false" not in keys
    assert read_spec(out) == read_spec(out).__class__(bits=4, group_size=32, sym=sym, head_bits=head, method="rtn")
    assert f"int4 {'sym' if sym else 'asym'} g32 (rtn), head {head} bits" in stdout
    ids = torch.randint(0, fq.config.vocab_size, (2, 32))
    ref = fq(ids).logits
    # the dequantized fp32 matmul; bf16 (every CPU runs it, natively or not); the probe's choice for
    # 64 rows on this CPU (bf16 where oneDNN has native bf16, else fp32)
    for kernel, tol in (("fp32", 1e-5), ("bf16", None), ("auto", 1e-4)):
        monkeypatch.setenv(KERNEL_ENV, kernel)
        wo, _ = load_model(out)
        assert_close_for_kernels(wo(ids).logits, ref, chosen_kernels(wo, ids.numel()), tol)
    monkeypatch.delenv(KERNEL_ENV)
    # a float model rounded the same way differs: the QAT trained what the conversion rounds
    flt, _ = load_model(float_run)
    assert (flt(ids).logits - ref).abs().max() > 1e-2

    if head == 4:  # greedy text of the QAT checkpoint and of its weight-only model agree
        texts = []
        for ckpt in (step, out):
            code, stdout, err = run_cli("generate", "--ckpt", ckpt, "--prompt", "the quick", "-o",
                                        "Generation.decode_strategy=greedy_search", "-o",
                                        "Generation.max_dec_len=8", "--no-stream")
            assert code == 0, err
            texts.append(stdout)
        assert texts[0] == texts[1]

    for flags, needle in ((("--weights", "int4", "--method", "gptq"), "--method gptq"),
                          (("--weights", "int4", "--group-size", "64"), "--group-size 64"),
                          (("--weights", "int8"), "--weights int8"),
                          (("--weights", "int4", "--avg-bits", "5"), "--avg-bits"),
                          (("--convert",), "Compress.Quantization.weight_only")):
        code, _, err = run_cli("quantize", "--ckpt", step, "--out", tmp_path / "x", *flags)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (flags, err)
    code, _, err = run_cli("export", "--format", "hf", "--ckpt", step, "--out", tmp_path / "hf")
    assert code == 2 and "4-bit QAT" in err and len(err.strip().splitlines()) == 1, err


def test_user_errors_are_one_line(run_cli, float_run, tmp_path):
    code, _, err = _qat(run_cli, float_run, tmp_path / "q", "group_size=48")
    assert code == 2 and "Compress.Quantization.group_size: 48" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli("ptq", "--ckpt", float_run, "--out", tmp_path / "p", "-o",
                           "Compress.Quantization.weight_only=true", "-o", "Compress.Quantization.weight_bits=4")
    assert code == 2 and "Compress.Quantization.weight_only" in err and len(err.strip().splitlines()) == 1
