"""Packing: several examples per row, attention never across examples, positions restarting;
the packed loss equals the loss of the same examples one per row (fp32, 1e-5)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from gf_testutil import tiny_model
from gptforge.data.chat_template import Encoded
from gptforge.data.packing import build_rows, packed_attention_mask

pytestmark = pytest.mark.usefixtures("one_thread")


def _examples(n: int, vocab: int, seed: int = 0) -> list[Encoded]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(3, 20)
        ids = [rng.randrange(vocab) for _ in range(k)]
        split = rng.randint(1, k - 1)
        out.append(Encoded(ids, [0] * split + [1] * (k - split)))
    return out


def _loss(model, rows, packed: bool) -> torch.Tensor:
    b = {k: torch.as_tensor(getattr(rows, k)) for k in ("tokens", "labels", "loss_mask", "position_ids", "segments")}
    mask = packed_attention_mask(b["segments"]) if packed else None
    pos = b["position_ids"] if packed else None  # unpacked rows: the model's own positions and causal mask
    return model(b["tokens"], position_ids=pos, attention_mask=mask, labels=b["labels"], loss_mask=b["loss_mask"]).loss


def test_packed_loss_equals_unpacked_loss():
    model, cfg = tiny_model()
    ex = _examples(24, cfg.Model.vocab_size)
    packed = build_rows(ex, 48, packing=True, seed=3)
    plain = build_rows(ex, 48, packing=False, seed=3)
    assert len(packed) < len(plain) == 24 and packed.examples == plain.examples == 24
    assert packed.loss_mask.sum() == plain.loss_mask.sum()
    with torch.no_grad():
        a, b = _loss(model, packed, True), _loss(model, plain, False)
    assert abs(float(a) - float(b)) < 1e-5, (float(a), float(b))
    # and the gradient is the same gradient
    model.zero_grad()
    _loss(model, packed, True).backward()
    g1 = model.blocks[0].attn.qkv_proj.weight.grad.clone()
    model.zero_grad()
    _loss(model, plain, False).backward()
    torch.testing.assert_close(g1, model.blocks[0].attn.qkv_proj.weight.grad, atol=1e-6, rtol=1e-4)


def test_attention_crossing_examples_would_change_the_loss():
    """The test above can fail: the same packed rows with a plain causal mask give another loss."""
    model, cfg = tiny_model()
    packed = build_rows(_examples(24, cfg.Model.vocab_size), 48, packing=True, seed=3)
    plain = build_rows(_examples(24, cfg.Model.vocab_size), 48, packing=False, seed=3)
    b = {k: torch.as_tensor(getattr(packed, k)) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    with torch.no_grad():
        leaky = model(b["tokens"], position_ids=b["position_ids"], labels=b["labels"], loss_mask=b["loss_mask"]).loss
        ref = _loss(model, plain, False)
    assert abs(float(leaky) - float(ref)) > 1e-4


def test_rows_layout():
    ex = [Encoded([1, 2, 3, 4], [0, 0, 1, 1]), Encoded([5, 6, 7], [0, 1, 1]), Encoded(list(range(30)), [1] * 30)]
    rows = build_rows(ex, 8, packing=True, seed=0)
    assert rows.dropped == 1 and rows.examples == 2 and len(rows) == 1
    seg, pos = rows.segments[0], rows.position_ids[0]
    assert sorted(set(seg.tolist())) == [0, 1, 2] and (seg > 0).sum() == 5
    for s in (1, 2):  # positions restart at 0 in each example
        assert pos[seg == s].tolist() == list(range(int((seg == s).sum())))
    assert (rows.labels[0][seg == 0] == -100).all() and rows.loss_mask[0][seg == 0].sum() == 0
    m = packed_attention_mask(torch.as_tensor(rows.segments))[0, 0]
    first = np.flatnonzero(seg == 1)
    second = np.flatnonzero(seg == 2)
    assert not m[second[:, None], first[None, :]].any() and not m[first[:, None], second[None, :]].any()
    assert m.diagonal().all()


def test_epochs_reshuffle():
    ex = _examples(10, 100)
    rows = build_rows(ex, 24, packing=False, seed=0, epochs=2)
    assert len(rows) == 20
    assert rows.tokens[:10].tolist() != rows.tokens[10:].tolist()
    assert sorted(map(tuple, rows.tokens[:10].tolist())) == sorted(map(tuple, rows.tokens[10:].tolist()))
