"""The sft step computes only what its loss depends on (finetune/sft.py `rows_loss`): the batch's
examples re-packed without padding (data/packing.py `compact_batch`) and, for LoRA, the head's
logits of the learned tokens only. The loss and the adapters' (or, fully tuned, all weights')
gradients equal the plain path's (the model's forward over the rows as given, full logits)
within 1e-5."""

from __future__ import annotations

import random

import pytest
import torch

from gf_testutil import tiny_model
from gptforge.adapters import apply_lora, trainable_parameters
from gptforge.config.schema import LoraConfig
from gptforge.data.chat_template import Encoded
from gptforge.data.packing import IGNORE, build_rows, compact_batch, packed_attention_mask
from gptforge.finetune.head_loss import frozen_head
from gptforge.finetune.sft import rows_loss

pytestmark = pytest.mark.usefixtures("one_thread")
KEYS = ("tokens", "labels", "loss_mask", "position_ids", "segments")


def _batch(packing: bool, vocab: int, n: int = 12, seq: int = 48, lengths=(5, 30)) -> dict:
    rng = random.Random(len(lengths) + n)
    ex = []
    for _ in range(n):
        k = rng.randint(*lengths)
        p = rng.randint(1, k - 2)  # a prompt of p tokens, then the learned answer
        ex.append(Encoded([rng.randrange(vocab) for _ in range(k)], [0] * p + [1] * (k - p)))
    rows = build_rows(ex, seq, packing=packing, seed=1)
    return {k: torch.as_tensor(getattr(rows, k)) for k in KEYS}


def _model(method: str):
    torch.manual_seed(0)
    model, cfg = tiny_model()
    if method == "lora":
        apply_lora(model, LoraConfig(r=4, alpha=8, targets=["all"]))
        with torch.no_grad():
            for _, p in trainable_parameters(model):
                p.normal_(0, 0.1)  # non-zero B: the adapters' gradients depend on every layer
    return model.train(), cfg


def _grads(model, loss) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _plain(model, b):
    """The reference: the model's own forward over the rows as given, logits for every position."""
    return model(b["tokens"], position_ids=b["position_ids"], attention_mask=packed_attention_mask(b["segments"]),
                 labels=b["labels"], loss_mask=b["loss_mask"]).loss


@pytest.mark.parametrize("packing,seq", [(False, 48), (True, 48), (True, 256)], ids=["padded", "packed", "packed-long"])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_rows_loss_equals_the_plain_loss_and_gradients(method, packing, seq):
    model, cfg = _model(method)
    b = _batch(packing, cfg.Model.vocab_size, n=24 if seq > 48 else 12, seq=seq)
    assert (frozen_head(model) is not None) == (method == "lora")
    want = _grads(model, _plain(model, b))
    got = _grads(model, rows_loss(model, b))
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert got[1].keys() == want[1].keys() and any(g.abs().sum() > 0 for g in got[1].values())
    for k in want[1]:
        torch.testing.assert_close(got[1][k], want[1][k], atol=1e-5, rtol=1e-4, msg=k)


def test_padded_rows_are_repacked_into_fewer_positions_with_the_same_tokens():
    _, cfg = tiny_model()
    b = _batch(False, cfg.Model.vocab_size, n=16, seq=64, lengths=(4, 12))
    c = compact_batch(b)
    assert c["tokens"].numel() < 0.5 * b["tokens"].numel() and int(c["segments"].max()) > 1
    def tokens(batch):  # (token, label, weight, position) of every real token
        live = batch["segments"] > 0
        return sorted(zip(*(batch[k][live].tolist() for k in KEYS[:4]), strict=True))

    assert tokens(c) == tokens(b)
    # long packed rows of short examples: the same examples in shorter rows, no more positions
    p = _batch(True, cfg.Model.vocab_size, n=40, seq=256, lengths=(4, 12))
    c = compact_batch(p)
    assert c["tokens"].shape[1] == 128 and c["tokens"].numel() <= p["tokens"].numel() and tokens(c) == tokens(p)
    assert (c["labels"][c["segments"] == 0] == IGNORE).all() and (c["loss_mask"][c["segments"] == 0] == 0).all()
    # each example stays whole, its positions 0, 1, ... in one row
    for row_pos, row_seg in zip(c["position_ids"], c["segments"], strict=True):
        for s in row_seg.unique().tolist():
            if s:
                assert row_pos[row_seg == s].tolist() == list(range(int((row_seg == s).sum())))


def test_full_rows_are_kept_and_a_padded_tail_is_cut():
    _, cfg = tiny_model()
    packed = _batch(True, cfg.Model.vocab_size, n=40, seq=32)
    full = {k: v[:2] for k, v in packed.items()}
    full["segments"][full["segments"] == 0] = 99  # the padding as one more example: no padding at all
    assert compact_batch(full) is full
    # long rows of one example each, the longest ending early: the rows are cut after it
    b = _batch(False, cfg.Model.vocab_size, n=3, seq=256, lengths=(100, 120))
    c = compact_batch(b)
    used = int((b["segments"] > 0).sum(1).max())
    assert c["tokens"].shape == (3, used) and torch.equal(c["tokens"], b["tokens"][:, :used])
