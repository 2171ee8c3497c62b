"""LoRA / DoRA adapters (gptforge.adapters) against peft over our HF export.

Every adapter here has non-zero B (and a magnitude away from the row norms for DoRA), so an
adapter that is ignored, transposed or put on the wrong rows changes the logits."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

from gf_testutil import tiny_model
from gptforge.adapters import (
    LoraPair,
    adapter_state_dict,
    apply_lora,
    count_parameters,
    load_adapter_state_dict,
    merge_adapters,
    trainable_parameters,
    unload,
)
from gptforge.adapters.layers import LoraLinear
from gptforge.adapters.peft_format import load_adapter, save_adapter
from gptforge.config.schema import LoraConfig
from gptforge.errors import CheckpointError, ConfigError, UsageError

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

ALL = ["q", "k", "v", "out_proj", "linear1", "linear2"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _model():
    torch.manual_seed(0)
    m, cfg = tiny_model("Model.vocab_size=512")
    return m, cfg


@torch.no_grad()
def _randomize(model, scale=0.2):
    """Non-zero B everywhere; DoRA magnitudes moved off the row norms."""
    for n, p in trainable_parameters(model):
        if n.endswith("magnitude"):
            p.mul_(1 + scale * torch.rand_like(p))
        else:
            p.normal_(0.0, scale)


def _hf(model, path):
    from gptforge.export.hf import save_hf

    save_hf(model, path)
    return transformers.GPT2LMHeadModel.from_pretrained(str(path)).eval()


IDS = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(1))


def _ours(model):
    with torch.no_grad():
        return model.eval()(IDS).logits


def _theirs(pm):
    with torch.no_grad():
        return pm.eval()(IDS).logits


# ------------------------------------------------------------------------------- a layer


@pytest.mark.parametrize("dora,rslora", [(False, False), (True, False), (False, True), (True, True)])
def test_a_layer_equals_peft(dora, rslora):
    torch.manual_seed(0)
    lin = nn.Linear(24, 40)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = copy.deepcopy(lin)

        def forward(self, x):
            return self.lin(x)

    pm = peft.get_peft_model(Net(), peft.LoraConfig(r=4, lora_alpha=6, target_modules=["lin"], use_dora=dora,
                                                    use_rslora=rslora))
    torch.nn.init.normal_(pm.base_model.model.lin.lora_B["default"].weight, 0, 0.3)
    if dora:
        with torch.no_grad():
            pm.base_model.model.lin.lora_magnitude_vector["default"].weight.mul_(1.3)
    layer = pm.base_model.model.lin
    ours = LoraLinear(copy.deepcopy(lin))
    pair = LoraPair(24, 40, 4, 6, rslora, dora=dora)
    with torch.no_grad():
        pair.lora_A.copy_(layer.lora_A["default"].weight)
        pair.lora_B.copy_(layer.lora_B["default"].weight)
        if dora:
            pair.magnitude.copy_(layer.lora_magnitude_vector["default"].weight)
    ours.add("full", pair)
    assert pair.scaling == pytest.approx(layer.scaling["default"], rel=1e-12)  # rsLoRA: alpha/sqrt(r)
    x = torch.randn(3, 5, 24)
    with torch.no_grad():
        want, got = pm(x), ours(x)
    assert (got - lin(x)).abs().max() > 1e-2  # the adapter does something
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- the model


def _peft_over(hf_model, adapter_dir):
    return peft.PeftModel.from_pretrained(hf_model, str(adapter_dir)).eval()


@pytest.mark.parametrize("dora,rslora", [(False, False), (True, True)])
def test_our_adapter_loads_in_peft_with_equal_logits(tmp_path, dora, rslora):
    base, _ = _model()
    hf = _hf(base, tmp_path / "hf")
    m = copy.deepcopy(base)
    apply_lora(m, LoraConfig(r=4, alpha=12, dora=dora, rslora=rslora, targets=[*ALL, "head"]))
    _randomize(m)
    save_adapter(m, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["use_dora"] is dora and cfg["use_rslora"] is rslora
    ours = _ours(m)
    assert (ours - _ours(base)).abs().max() > 1e-2
    torch.testing.assert_close(_theirs(_peft_over(hf, tmp_path / "adapter")), ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dora", [False, True])
def test_peft_adapter_loads_in_ours_with_equal_logits(tmp_path, dora):
    base, _ = _model()
    hf = _hf(base, tmp_path / "hf")
    pc = peft.LoraConfig(r=4, lora_alpha=8, use_dora=dora, fan_in_fan_out=True,
                         target_modules=["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"],
                         rank_pattern={"transformer.h.1.mlp.c_fc": 2}, alpha_pattern={"c_attn": 5})
    pm = peft.get_peft_model(hf, pc)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
            elif "magnitude" in n:
                p.mul_(1.25)
    pm.save_pretrained(str(tmp_path / "peft"))
    m = copy.deepcopy(base)
    names = load_adapter(m, tmp_path / "peft")
    assert len(names) == 8
    assert m.blocks[1].linear1.adapters["full"].r == 2
    torch.testing.assert_close(_ours(m), _theirs(pm), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dora", [False, True])
def test_qkv_slices_of_different_ranks_are_one_exact_c_attn_adapter(tmp_path, dora):
    base, _ = _model()
    hf = _hf(base, tmp_path / "hf")
    m = copy.deepcopy(base)
    apply_lora(m, LoraConfig(r=2, alpha=4, dora=dora, targets=["q", "v"], layers=[1]))
    # Slices with their own ranks and scalings (as a loaded or hand-made adapter can have).
    qkv = m.blocks[1].attn.qkv_proj
    qkv.adapters["v"] = LoraPair(64, 64, 3, 9.0, dora=dora)
    qkv.adapters["v"].reset("kaiming", qkv.slice_rows(qkv.base.weight.detach(), "v"))
    _randomize(m)
    save_adapter(m, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["transformer.h.1.attn.c_attn"] and cfg["r"] == 5  # rank 2 + 3
    torch.testing.assert_close(_theirs(_peft_over(hf, tmp_path / "a")), _ours(m), atol=1e-5, rtol=0)
    back = copy.deepcopy(base)
    load_adapter(back, tmp_path / "a")
    assert sorted(back.blocks[1].attn.qkv_proj.adapters) == ["q", "v"]
    assert back.blocks[1].attn.qkv_proj.adapters["v"].r == 3
    for k, v in adapter_state_dict(m).items():
        torch.testing.assert_close(adapter_state_dict(back)[k], v, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------- merging


@pytest.mark.parametrize("dora", [False, True])
def test_merged_equals_unmerged_and_merging_twice_is_merging_once(dora):
    m, _ = _model()
    apply_lora(m, LoraConfig(r=4, alpha=8, dora=dora, targets=["q", "k", "out_proj", "linear1", "linear2"]))
    _randomize(m)
    unmerged = _ours(m)
    assert merge_adapters(m) == 8
    once = _ours(m)
    weights = {k: v.clone() for k, v in m.state_dict().items()}
    assert merge_adapters(m) == 0  # recorded: nothing merged a second time
    torch.testing.assert_close(once, unmerged, atol=1e-5, rtol=0)
    assert all(torch.equal(weights[k], v) for k, v in m.state_dict().items())
    torch.testing.assert_close(_ours(unload(m)), once, atol=0, rtol=0)
    assert type(m.blocks[0].attn.qkv_proj) is nn.Linear


def test_a_head_adapter_is_refused_by_merge():
    m, _ = _model()
    apply_lora(m, LoraConfig(targets=["head"]))
    with pytest.raises(UsageError, match="tied"):
        merge_adapters(m)


# ----------------------------------------------------------------------- quantized bases


def _quantized():
    from gptforge.compress.int8 import convert_model
    from gptforge.compress.quant import quantize_model
    from gptforge.config.schema import QuantizationConfig

    m, _ = _model()
    quantize_model(m, QuantizationConfig(enable=True))
    m.train()
    with torch.no_grad():
        for _ in range(3):
            m(IDS)  # the activation scales' moving averages
    qat = copy.deepcopy(m.eval())
    convert_model(m)
    return qat, m


def _int8_reference(lin, x):
    """The INT8 layer as float arithmetic: fake-quantized input (static step) × dequantized weight."""
    step = float(lin.input_scale)
    xq = torch.fake_quantize_per_tensor_affine(x.clamp(-127 * step, 127 * step), step, 0, -127, 127)
    return nn.functional.linear(xq, lin.dequantized_weight(), lin.bias)


@pytest.mark.parametrize("dora", [False, True])
def test_lora_over_int8_is_the_int8_output_plus_a_float_delta(dora):
    _, m = _quantized()
    apply_lora(m, LoraConfig(r=4, alpha=8, dora=dora, targets=["q", "v", "linear1"]))
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


# ------------------------------------------------------------------------- exact resume


def _steps(model, opt, n):
    model.train()
    for _ in range(n):
        loss = model(IDS[:, :-1], labels=IDS[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def _lora_run(seed):
    m, cfg = _model()
    torch.manual_seed(seed)
    apply_lora(m, LoraConfig(r=4, alpha=8, dora=True, dropout=0.1, targets=["q", "v", "linear2", "head"]))
    opt = torch.optim.AdamW([p for _, p in trainable_parameters(m)], lr=1e-2)
    return m, cfg, opt


def test_adapter_and_optimizer_state_resume_exactly_through_a_step_checkpoint(tmp_path):
    from gptforge.config.schema import MixPrecisionConfig
    from gptforge.train import checkpoint as ckpt
    from gptforge.train.precision import Precision

    def parts(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), Precision(MixPrecisionConfig(), torch.device("cpu"))

    m, _, opt = _lora_run(3)
    torch.manual_seed(7)
    _steps(m, opt, 4)
    want = adapter_state_dict(m)

    m, cfg, opt = _lora_run(3)
    torch.manual_seed(7)
    _steps(m, opt, 2)
    sched, prec = parts(opt)
    path = ckpt.save_checkpoint(tmp_path, 2, m, cfg, None, opt, sched, prec, {"run_id": "x"})
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}

    m2, _, opt2 = _lora_run(99)  # other initial adapters: everything must come from the checkpoint
    sched2, prec2 = parts(opt2)
    ckpt.load_model_weights(path, m2)
    ckpt.load_training_state(path, opt2, sched2, prec2)  # also the RNG (adapter dropout)
    assert {n for n, p in m2.named_parameters() if not p.requires_grad} == frozen
    _steps(m2, opt2, 2)
    got = adapter_state_dict(m2)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    n, total = count_parameters(m2)
    assert n == sum(t.numel() for t in got.values()) and 0 < n < total


def test_adapter_state_dict_loads_back_and_refuses_another_shape():
    m, _, _ = _lora_run(0)
    _randomize(m)
    sd = adapter_state_dict(m)
    m2, _, _ = _lora_run(1)
    load_adapter_state_dict(m2, sd)
    torch.testing.assert_close(_ours(m2), _ours(m), atol=0, rtol=0)
    m3, _ = _model()
    apply_lora(m3, LoraConfig(r=2, targets=["q", "v", "linear2", "head"], dora=True))
    with pytest.raises(CheckpointError, match="shape"):
        load_adapter_state_dict(m3, sd)


# ------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("cfg,match", [
    (LoraConfig(layers=[7]), r"lora.layers: \[7\] match no block"),
    (LoraConfig(targets=["c_attn"]), r"lora.targets: \['c_attn'\] not among"),
    (LoraConfig(targets=[]), "lora.targets: empty"),
    (LoraConfig(targets=["qkv", "q"]), "overlap"),
    (LoraConfig(r=0), "lora.r: must be a positive integer"),
    (LoraConfig(init="pissa"), "lora.init"),
])
def test_a_target_that_matches_nothing_is_a_one_line_error(cfg, match):
    m, _ = _model()
    with pytest.raises(ConfigError, match=match) as e:
        apply_lora(m, cfg)
    assert "\n" not in str(e.value)


def test_moe_expert_tensors_are_refused():
    torch.manual_seed(0)
    m, _ = tiny_model("Model.vocab_size=512", "Model.num_experts=2")
    with pytest.raises(ConfigError, match="Mixture-of-Experts"):
        apply_lora(m, LoraConfig(targets=["linear1"]))
    apply_lora(m, LoraConfig(targets=["q", "out_proj"]))  # attention of an MoE model is fine


def test_peft_options_without_a_meaning_here_are_refused(tmp_path):
    m, _ = _model()
    apply_lora(m, LoraConfig(targets=["linear1"]))
    save_adapter(m, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": ["wte"]}))
    with pytest.raises(CheckpointError, match="modules_to_save"):
        load_adapter(_model()[0], tmp_path / "a")
    with pytest.raises(CheckpointError, match="not found"):
        load_adapter(_model()[0], tmp_path / "nowhere")
    other, _ = tiny_model("Model.vocab_size=512", "Model.hidden_size=32", "Model.num_attention_heads=2")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="do not fit"):
        load_adapter(other, tmp_path / "a")


# ------------------------------------------------------------------------------- the CLI


def _adapter_pair(tmp_path, base, cfg, dora=False, scale=0.2):
    from gptforge.model_io import save_model_dir

    save_model_dir(base, cfg, tmp_path / "base")
    m = copy.deepcopy(base)
    apply_lora(m, LoraConfig(r=4, alpha=8, dora=dora, targets=["q", "v", "linear1", "linear2"]))
    _randomize(m, scale)
    save_adapter(m, tmp_path / "adapter")
    return m


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
    from gptforge.compress.int8 import converted_config
    from gptforge.config.schema import QuantizationConfig
    from gptforge.model_io import load_model

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
