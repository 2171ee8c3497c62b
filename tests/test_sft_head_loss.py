"""The chunked frozen-head loss of LoRA sft steps (finetune/head_loss.py): the loss and the
adapters' gradients equal `lm_loss` over full logits, and peft's over our HF export."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from gptforge.adapters import apply_lora, trainable_parameters
from gptforge.config.schema import LoraConfig
from gptforge.finetune import head_loss
from gptforge.finetune.head_loss import frozen_head, frozen_head_loss
from lora_support import _hf, _model, _randomize

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.randint(0, 512, (3, 17), generator=torch.Generator().manual_seed(4))


def _lora(targets=("all",)):
    m, cfg = _model()
    base = copy.deepcopy(m)
    apply_lora(m, LoraConfig(r=4, alpha=8, targets=list(targets)))
    _randomize(m)
    return base, m.train(), cfg


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in trainable_parameters(model)}


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_chunked_frozen_head_loss_equals_lm_loss_and_its_gradients(monkeypatch, scale):
    monkeypatch.setattr(head_loss, "CHUNK_ROWS", 7)  # 48 rows: several chunks and a short last one
    _, m, _ = _lora()
    labels = IDS[:, 1:].clone()
    labels[0, :5] = -100
    mask = torch.ones(labels.shape)
    mask[2, 3:9] = 0
    head = frozen_head(m)
    assert head is m.wte.weight
    want = m(IDS[:, :-1], labels=labels, loss_mask=mask).loss
    gw = _grads(m, want * scale)
    got = frozen_head_loss(m.hidden_states(IDS[:, :-1]), head, labels, mask)
    gg = _grads(m, got * scale)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert gw.keys() == gg.keys() and any(g.abs().sum() > 0 for g in gg.values())
    for k in gw:
        torch.testing.assert_close(gg[k], gw[k], atol=1e-7, rtol=1e-5)


def test_the_loss_and_gradients_equal_peft_over_our_hf_export(tmp_path):
    peft = pytest.importorskip("peft")
    from gptforge.adapters.peft_format import save_adapter

    base, m, _ = _lora()
    save_adapter(m, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(_hf(base, tmp_path / "hf"), str(tmp_path / "adapter"),
                                            is_trainable=True).train()
    for mod in pm.modules():  # dropout off in both (ours: the tiny config has none)
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    ours = frozen_head_loss(m.hidden_states(IDS[:, :-1]), frozen_head(m), IDS[:, 1:])
    theirs = pm(input_ids=IDS, labels=IDS).loss
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    g = _grads(m, ours)
    theirs.backward()
    named = dict(pm.named_parameters())
    for i in range(len(m.blocks)):  # the MLP adapters: same [r, in] / [out, r] layout in both
        for ours_name, hf_name in (("linear1", "mlp.c_fc"), ("linear2", "mlp.c_proj")):
            for ab in ("lora_A", "lora_B"):
                want = named[f"base_model.model.transformer.h.{i}.{hf_name}.{ab}.default.weight"].grad
                torch.testing.assert_close(g[f"blocks.{i}.{ours_name}.adapters.full.{ab}"], want, atol=1e-6, rtol=1e-4)


def test_only_a_plain_frozen_tied_head_takes_the_chunked_loss():
    from gptforge.transforms.quant import quantize_model

    _, m, _ = _lora()
    assert frozen_head(m) is not None
    _, with_head, _ = _lora(("q", "head"))
    assert frozen_head(with_head) is None  # a head adapter: its own projection
    full, _ = _model()
    assert frozen_head(full) is None  # full fine-tuning: the head takes a gradient
    from gptforge.config.schema import QuantizationConfig

    q = copy.deepcopy(full)
    quantize_model(q, QuantizationConfig(enable=True, quantize_embedding=True))
    for p in q.parameters():
        p.requires_grad_(False)
    assert frozen_head(q) is None  # a fake-quant head projects with its quantized weight


def test_a_batch_without_learned_tokens_has_zero_loss_and_gradient():
    _, m, _ = _lora()
    labels = IDS[:, 1:]
    mask = torch.zeros(labels.shape)
    want = m(IDS[:, :-1], labels=labels, loss_mask=mask).loss
    got = frozen_head_loss(m.hidden_states(IDS[:, :-1]), frozen_head(m), labels, mask)
    assert float(want.detach()) == float(got.detach()) == 0.0
    assert all(float(g.abs().sum()) == 0.0 for g in _grads(m, got).values())


def test_a_hooked_or_wrapped_model_keeps_its_forward():
    _, m, _ = _lora()
    handle = m.register_forward_pre_hook(lambda mod, args: None)  # e.g. FSDP's parameter gathers
    assert frozen_head(m) is None
    handle.remove()
    assert frozen_head(m) is not None
    assert frozen_head(torch.nn.Sequential(m)) is None
