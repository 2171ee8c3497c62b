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
    base_state_dict,
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
from lora_support import (
    ALL,
    IDS,
    _hf,
    _model,
    _ours,
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


# ------------------------------------------------------------------------------- a layer


@pytest.mark.parametrize("dora,rslora,dropout", [(False, False, 0.0), (True, False, 0.0), (False, True, 0.0),
                                                 (True, True, 0.0), (False, False, 0.3), (True, False, 0.3)])
def test_a_layer_equals_peft(dora, rslora, dropout):
    torch.manual_seed(0)
    lin = nn.Linear(24, 40)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = copy.deepcopy(lin)

        def forward(self, x):
            return self.lin(x)

    pm = peft.get_peft_model(Net(), peft.LoraConfig(r=4, lora_alpha=6, target_modules=["lin"], use_dora=dora,
                                                    use_rslora=rslora, lora_dropout=dropout))
    torch.nn.init.normal_(pm.base_model.model.lin.lora_B["default"].weight, 0, 0.3)
    if dora:
        with torch.no_grad():
            pm.base_model.model.lin.lora_magnitude_vector["default"].weight.mul_(1.3)
    layer = pm.base_model.model.lin
    ours = LoraLinear(copy.deepcopy(lin))
    pair = LoraPair(24, 40, 4, 6, rslora, dropout=dropout, dora=dora)
    with torch.no_grad():
        pair.lora_A.copy_(layer.lora_A["default"].weight)
        pair.lora_B.copy_(layer.lora_B["default"].weight)
        if dora:
            pair.magnitude.copy_(layer.lora_magnitude_vector["default"].weight)
    ours.add("full", pair)
    assert pair.scaling == pytest.approx(layer.scaling["default"], rel=1e-12)  # rsLoRA: alpha/sqrt(r)
    x = torch.randn(3, 5, 24)
    with torch.no_grad():
        want, got = pm.eval()(x), ours.eval()(x)
    assert (got - lin(x)).abs().max() > 1e-2  # the adapter does something
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if dropout:  # training: the same dropout mask (one draw of the same RNG) gives the same output
        pm.train()
        ours.train()
        torch.manual_seed(5)
        want = pm(x)
        torch.manual_seed(5)
        got = ours(x)
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
    again = copy.deepcopy(m)  # the merged state travels with the weights (a checkpoint of a merged model)
    for mod in again.modules():
        if isinstance(mod, LoraLinear):
            mod.merged = False
    again.load_state_dict(m.state_dict())
    assert merge_adapters(again) == 0
    torch.testing.assert_close(_ours(unload(m)), once, atol=0, rtol=0)
    assert type(m.blocks[0].attn.qkv_proj) is nn.Linear


def test_a_head_adapter_is_refused_by_merge():
    m, _ = _model()
    apply_lora(m, LoraConfig(targets=["head"]))
    with pytest.raises(UsageError, match="tied"):
        merge_adapters(m)


# ------------------------------------------------------------------------- exact resume


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


def test_base_state_dict_is_the_plain_model_without_its_adapters():
    base, _ = _model()
    m = copy.deepcopy(base)
    apply_lora(m, LoraConfig(targets=["q", "linear2", "head"], dora=True))
    _randomize(m)
    sd = base_state_dict(m)
    assert sd.keys() == base.state_dict().keys()
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in sd.items())


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


def test_moe_expert_tensors_are_refused(tmp_path):
    torch.manual_seed(0)
    m, _ = tiny_model("Model.vocab_size=512", "Model.num_experts=2")
    with pytest.raises(ConfigError, match="Mixture-of-Experts"):
        apply_lora(m, LoraConfig(targets=["linear1"]))
    apply_lora(m, LoraConfig(targets=["q", "out_proj"]))  # attention of an MoE model is fine
    m.eval()(IDS)
    with pytest.raises(UsageError, match="no PEFT form"):
        save_adapter(m, tmp_path / "a")
    merge_adapters(m)


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
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(CheckpointError, match="lacks lora_magnitude_vector"):
        load_adapter(_model()[0], tmp_path / "a")
    other, _ = tiny_model("Model.vocab_size=512", "Model.hidden_size=32", "Model.num_attention_heads=2")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="do not fit"):
        load_adapter(other, tmp_path / "a")


