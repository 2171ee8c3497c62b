"""Training with our LoRA is training with peft's: from the same start (A as peft draws it,
B = 0) the loss and every adapter gradient of two consecutive AdamW steps equal peft's over our
HF export. Step 1 has B = 0, so only B gets a gradient; step 2 (after one update) checks A too,
so an adapter that gets no gradient, or a wrong one, fails here."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from gptforge.adapters import apply_lora, trainable_parameters
from gptforge.adapters.peft_format import peft_parts, save_adapter
from gptforge.config.schema import LoraConfig
from lora_support import IDS, _hf, _model

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")


def _grads_in_peft_names(model) -> dict[str, torch.Tensor]:
    """Our adapter gradients under peft's names and layout (peft_parts applied to the gradients)."""
    g = copy.deepcopy(model)
    with torch.no_grad():
        for (_, p), (_, q) in zip(trainable_parameters(g), trainable_parameters(model), strict=True):
            p.copy_(q.grad)
    return peft_parts(g)[0]


# One adapter over the fused QKV (peft's c_attn); separate q/k/v slices are the same function but
# another parameterization (peft trains the off-diagonal blocks of their stacked B too).
@pytest.mark.parametrize("dora", [False, True])
def test_two_lora_training_steps_equal_peft(tmp_path, dora):
    base, _ = _model()
    hf = _hf(base, tmp_path / "hf")
    ours = copy.deepcopy(base)
    torch.manual_seed(3)
    apply_lora(ours, LoraConfig(r=4, alpha=8, dora=dora, targets=["qkv", "out_proj", "linear1", "linear2", "head"]))
    save_adapter(ours, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter"), is_trainable=True)
    mine = [p for _, p in trainable_parameters(ours)]
    their = {n.replace(".default", "").replace("vector.weight", "vector"): p for n, p in theirs.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in mine) == sum(p.numel() for p in their.values())
    opt_a = torch.optim.AdamW(mine, lr=1e-2)
    opt_b = torch.optim.AdamW(list(their.values()), lr=1e-2)
    for step in range(2):
        la = ours.eval()(IDS[:, :-1], labels=IDS[:, 1:]).loss  # eval: no dropout on either side
        lb = theirs.eval()(IDS, labels=IDS).loss
        la.backward()
        lb.backward()
        torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)
        want = {k: v.grad for k, v in their.items()}
        got = _grads_in_peft_names(ours)
        assert got.keys() == want.keys()
        for k in got:
            torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-4, msg=k)
        nonzero = [k for k in got if got[k].abs().sum() > 0]
        # step 1: B = 0, so A has no gradient (B and DoRA's magnitude do); step 2: every tensor has one
        assert nonzero == [k for k in got if step or "lora_A" not in k], nonzero
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
