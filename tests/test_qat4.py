"""4-bit weight-only QAT (`Compress.Quantization.weight_only`): the fake quant is round-to-nearest's
grid exactly, its gradient is the straight-through estimator, and `gptforge quantize --weights
int4` of a QAT checkpoint computes the fake-quant model's logits; user errors name the key."""

from __future__ import annotations

import dataclasses
import json

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


@pytest.mark.parametrize("sym", [True, False])
def test_clip_search_rounds_each_group_at_least_as_well_as_round_to_nearest(sym):
    w = torch.randn(16, 128)  # Gaussian groups: clipping their tails buys finer steps for the rest
    scale, zero = lowbit.clip_search(w, 4, 32, sym)

    def group_err(q, s, z):
        return (lowbit.dequantize(q, s, z, 32) - w).square().reshape(16, 4, 32).sum(-1)

    q = lowbit.quantize_cols(w.reshape(64, 32), scale.reshape(-1), zero.reshape(-1), 4).reshape(16, 128)
    mine, rtn = group_err(q, scale, zero), group_err(*lowbit.rtn_grid(w, 4, 32, sym))
    assert (mine <= rtn).all() and mine.sum() < 0.97 * rtn.sum()
    if sym:
        assert torch.equal(zero, torch.zeros_like(zero))


def test_learned_scale_gradient_is_lsqs():
    """d w_hat / d s of one group against the LSQ paper's formula (Esser et al. 2020, eq. 3):
    round(w/s) - w/s inside the range, the clamp bound outside; the weight's gradient passes
    straight through inside the range and is zero where the weight is clipped."""
    w = torch.tensor([[0.05, -0.31, 0.9, -1.7, 0.33, 0.0, 2.5, -0.02]], requires_grad=True)
    s0 = torch.tensor([[0.2]])
    log_scale = s0.log().requires_grad_()
    w_hat = lowbit.fake_quantize_learned(w, log_scale, torch.zeros(1, 1), 4, 0)
    upstream = torch.arange(1.0, 9.0)[None]
    (w_hat * upstream).sum().backward()
    s = float(log_scale.detach().exp())
    v = w.detach() / s
    inside = (v.round() >= -8) & (v.round() <= 7)
    dwhat_ds = torch.where(inside, v.round() - v, v.round().clamp(-8, 7))
    torch.testing.assert_close(log_scale.grad, (upstream * dwhat_ds).sum().reshape(1, 1) * s)  # d s / d log s = s
    torch.testing.assert_close(w.grad, upstream * inside)
    assert not inside.all()  # 2.5 / 0.2 = 12.5 is clipped to 7


def test_learned_scales_start_at_the_clip_search_grid_and_train_without_decay():
    from gf_testutil import tiny_model
    from gptforge.train.optim import param_groups

    model, cfg = tiny_model()
    w = model.blocks[0].linear1.weight.detach().clone()
    q = QuantizationConfig(enable=True, weight_only=True, weight_bits=4, group_size=32, head_bits=4, weight_sym=False,
                           learn_scales=True, scale_lr_mult=20.0)
    quantize_model(model, q)
    lin = model.blocks[0].linear1
    scale, zero = lowbit.clip_search(w, 4, 32, False)
    qi, s, z = lin.grid()
    assert torch.equal(s, scale.log().exp()) and torch.equal(z, zero) and qi.dtype == torch.int8
    stored = WeightOnlyLinear.from_float(w, None, 4, 32, False, (qi, s, z)).dequantized_weight()
    assert torch.equal(lin.quantized_weight(), stored)  # what a converted layer computes, bit for bit
    ids = torch.randint(0, cfg.Model.vocab_size, (2, 8))
    lookup = model.wte(ids)  # the lookup reads the learned grid of the rows it reads
    assert torch.equal(lookup, model.wte.quantized_weight()[ids])
    groups = {n: (g["lr_mult"], g["weight_decay"]) for g in param_groups(model, 0.1) for n in g["names"]}
    scales = [n for n in groups if n.endswith("weight_log_scale")]
    assert len(scales) == 4 * cfg.Model.num_layers + 1 and {groups[n] for n in scales} == {(20.0, 0.0)}
    assert groups["blocks.0.linear1.weight"] == (1.0, 0.1)
    # a checkpoint loaded with assign=True keeps the scales' multiplier (a resumed run's optimizer)
    again, _ = tiny_model()
    quantize_model(again.to("meta"), q)
    again.load_state_dict(model.state_dict(), assign=True)
    assert again.blocks[0].linear1.weight_log_scale.lr_mult == 20.0
    assert torch.equal(again.blocks[0].linear1.quantized_weight(), lin.quantized_weight())


@pytest.mark.parametrize("key,value,needle", [
    ("scale_lr_mult", -1.0, "Compress.Quantization.scale_lr_mult"),
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


def test_learn_scales_needs_weight_only():
    with pytest.raises(ConfigError, match="Compress.Quantization.learn_scales: .*weight_only: true"):
        validate_config(QuantizationConfig(enable=True, learn_scales=True), 2)


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


@pytest.mark.parametrize("keys", [("head_bits=4",), ("weight_sym=false", "head_bits=8"),
                                  ("head_bits=4", "learn_scales=true")])
def test_qat_checkpoint_converts_to_a_weight_only_model_with_its_logits(run_cli, float_run, tmp_path, monkeypatch,
                                                                        keys):
    from gf_testutil import assert_close_for_kernels, chosen_kernels
    from gptforge.model_io import load_model

    code, _, err = _qat(run_cli, float_run, tmp_path / "qat", *keys)
    assert code == 0, err
    step = tmp_path / "qat" / "step_3"
    sd, fsd = load_file(str(step / "model.safetensors")), load_file(str(float_run / "model.safetensors"))
    learned = "learn_scales=true" in keys
    scales = {k for k in sd if k.endswith(("weight_log_scale", "weight_qzero"))}
    assert set(sd) - scales == set(fsd)  # the float master weights (and the learned grids)
    assert bool(scales) == learned
    assert not torch.equal(sd["blocks.0.linear1.weight"], fsd["blocks.0.linear1.weight"])  # trained
    if learned:  # the scales trained too, away from where clip_search started them
        start, _ = lowbit.clip_search(fsd["blocks.0.linear1.weight"], 4, 32, True)
        assert not torch.equal(sd["blocks.0.linear1.weight_log_scale"], start.log())
    fq, _ = load_model(step)
    assert isinstance(fq.blocks[0].linear2, WeightQuantLinear)

    out = tmp_path / "int4"
    code, stdout, err = run_cli("quantize", "--ckpt", step, "--out", out, "--weights", "int4")  # grid from the QAT
    assert code == 0, err
    head = 4 if "head_bits=4" in keys else 8
    sym = "weight_sym=false" not in keys
    assert read_spec(out) == read_spec(out).__class__(bits=4, group_size=32, sym=sym, head_bits=head, method="rtn")
    assert json.loads((out / "weight_only.json").read_text())["learned_scales"] is learned
    method = "the QAT model's learned scales" if learned else "rtn"
    assert f"int4 {'sym' if sym else 'asym'} g32 ({method}), head {head} bits" in stdout
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
                          (("--weights", "int4", "--clip-search"), "--clip-search"),
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


def test_learned_scales_resume_exactly(run_cli, float_run, tmp_path):
    """Two steps, then a resume for two more, end on the weights and learned scales of four
    straight steps (the scales' own lr multiplier and no-decay group survive the reload)."""
    opts = [a for k in ("weight_only=true", "weight_bits=4", "group_size=32", "head_bits=4", "learn_scales=true")
            for a in ("-o", f"Compress.Quantization.{k}")]
    common = ["-o", "Engine.eval_freq=100", "-o", "Optimizer.lr.max_lr=1e-2", "-o", "Optimizer.lr.decay_steps=4",
              "--no-progress", *opts]
    for out, steps in (("straight", 4), ("split", 2)):
        code, _, err = run_cli("qat", "--ckpt", float_run, "--out", tmp_path / out, "-o", f"Engine.max_steps={steps}",
                               "-o", f"Engine.save_load.save_steps={steps}", *common)
        assert code == 0, err
    code, _, err = run_cli("qat", "--ckpt", tmp_path / "split" / "step_2", "-o", "Engine.max_steps=4",
                           "-o", "Engine.save_load.save_steps=4", "--no-progress")
    assert code == 0, err
    a, b = (load_file(str(tmp_path / d / "step_4" / "model.safetensors")) for d in ("split", "straight"))
    assert set(a) == set(b) and any(k.endswith("weight_log_scale") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = load_file(str(tmp_path / "split" / "step_2" / "model.safetensors"))
    assert not torch.equal(start["wte.weight_log_scale"], a["wte.weight_log_scale"])  # the resumed steps moved them
