"""The sft step's attention mask: plain causal attention (no [T, T] mask) when no row holds
more than one example, the block-diagonal mask otherwise; same loss and adapter gradients."""

from __future__ import annotations

import random

import pytest
import torch

from gf_testutil import tiny_model
from gptforge.adapters import apply_lora, trainable_parameters
from gptforge.config.schema import LoraConfig
from gptforge.data.chat_template import Encoded
from gptforge.data.packing import build_rows, packed_attention_mask
from gptforge.finetune.sft import rows_attention_mask

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(packing: bool, vocab: int):
    rng = random.Random(0)
    ex = []
    for _ in range(8):
        k = rng.randint(5, 30)
        ex.append(Encoded([rng.randrange(vocab) for _ in range(k)], [0] * 2 + [1] * (k - 2)))
    rows = build_rows(ex, 32, packing=packing, seed=1)
    return {k: torch.as_tensor(getattr(rows, k)) for k in ("tokens", "labels", "loss_mask", "position_ids", "segments")}


def _loss_and_grads(model, b, mask):
    model.zero_grad()
    loss = model(b["tokens"], position_ids=b["position_ids"], attention_mask=mask, labels=b["labels"],
                 loss_mask=b["loss_mask"]).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for _, p in trainable_parameters(model)]


def test_one_example_rows_take_plain_causal_attention_with_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model, cfg = tiny_model()
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["all"]))
    with torch.no_grad():
        for _, p in trainable_parameters(model):
            p.normal_(0, 0.1)  # non-zero B: the adapters' gradients depend on the attention too
    model.train()
    plain = _rows(False, cfg.Model.vocab_size)
    assert (plain["segments"] == 0).any()  # padded rows: padding follows each example
    assert rows_attention_mask(plain["segments"]) is None
    want = _loss_and_grads(model, plain, packed_attention_mask(plain["segments"]))
    got = _loss_and_grads(model, plain, None)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_packed_rows_keep_the_block_diagonal_mask():
    _, cfg = tiny_model()
    packed = _rows(True, cfg.Model.vocab_size)
    assert int(packed["segments"].max()) > 1
    # Plain causal attention here would let examples see each other (test_sft_packing.py shows
    # that changes the loss): the mask must be the block-diagonal one.
    assert torch.equal(rows_attention_mask(packed["segments"]), packed_attention_mask(packed["segments"]))
