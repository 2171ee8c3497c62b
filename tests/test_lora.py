"""LoRA / DoRA adapters (gptforge.adapters) against peft over our HF export.

Every adapter here has non-zero B (and a magnitude away from the row norms for DoRA), so an
adapter that is ignored, transposed or put on the wrong rows changes the logits."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from gf_testutil import tiny_model
from torch import nn

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
