"""Helpers shared by the LoRA/DoRA tests (test_lora.py, test_lora_quant_cli.py)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from gf_testutil import tiny_model
from gptforge.adapters import apply_lora, trainable_parameters
from gptforge.adapters.peft_format import save_adapter
from gptforge.config.schema import LoraConfig

ALL = ["q", "k", "v", "out_proj", "linear1", "linear2"]


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
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(str(path)).eval()


IDS = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(1))


def _ours(model):
    with torch.no_grad():
        return model.eval()(IDS).logits


def _theirs(pm):
    with torch.no_grad():
        return pm.eval()(IDS).logits


def _quantized():
    from gptforge.config.schema import QuantizationConfig
    from gptforge.transforms.int8 import convert_model
    from gptforge.transforms.quant import quantize_model

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


def _steps(model, opt, n):
    model.train()
    for _ in range(n):
        loss = model(IDS[:, :-1], labels=IDS[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def _adapter_pair(tmp_path, base, cfg, dora=False, scale=0.2):
    from gptforge.model_io import save_model_dir

    save_model_dir(base, cfg, tmp_path / "base")
    m = copy.deepcopy(base)
    apply_lora(m, LoraConfig(r=4, alpha=8, dora=dora, targets=["q", "v", "linear1", "linear2"]))
    _randomize(m, scale)
    save_adapter(m, tmp_path / "adapter")
    return m

