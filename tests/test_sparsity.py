"""2:4 semi-structured sparsity: masks, Wanda scores, the pattern kept through training."""

from __future__ import annotations

import pytest
import torch

from gf_testutil import tiny_model
from gptforge.transforms.sparsity import (
    SparsityKeeper,
    compute_masks,
    input_norms,
    is_2_4,
    mask_2_4,
    masks_from_weights,
    target_layers,
    to_semi_structured,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_mask_keeps_the_two_largest_of_every_four():
    score = torch.tensor([[0.1, 0.9, 0.5, 0.2, 4.0, 3.0, 2.0, 1.0],
                          [1.0, 1.5, 0.0, 2.0, -1.0, 0.0, 0.5, 0.25]])
    assert mask_2_4(score).tolist() == [[False, True, True, False, True, True, False, False],
                                        [False, True, False, True, False, False, True, True]]
    w = torch.randn(16, 32)
    m = mask_2_4(w.abs())
    assert (m.reshape(16, 8, 4).sum(-1) == 2).all()
    assert is_2_4(w * m) and not is_2_4(w)
    # in every group the smallest kept |w| is at least the largest dropped |w|
    g, k = w.abs().reshape(16, 8, 4), m.reshape(16, 8, 4)
    assert (g.masked_fill(~k, float("inf")).amin(-1) >= g.masked_fill(k, -1.0).amax(-1)).all()


def test_wanda_scores_weights_by_input_feature_norms():
    model, _ = tiny_model()
    batches = [{"tokens": torch.randint(0, 4096, (2, 12))} for _ in range(2)]
    layers = target_layers(model)
    norms = input_norms(model, layers, batches)
    # independent: the inputs of linear2 are GELU(linear1(LN2 h)); capture them directly
    seen = []
    h = model.blocks[1].linear2.register_forward_hook(lambda m, a, o: seen.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    for b in batches:
        model(b["tokens"])
    h.remove()
    x = torch.cat(seen)
    torch.testing.assert_close(norms["blocks.1.linear2"], x.norm(dim=0), rtol=1e-5, atol=1e-6)
    masks = compute_masks(model, "wanda", batches)
    w = layers["blocks.1.linear2"].weight.detach().abs()
    torch.testing.assert_close(masks["blocks.1.linear2"], mask_2_4(w * x.norm(dim=0)[None]))
    assert not torch.equal(masks["blocks.1.linear2"], compute_masks(model, "magnitude")["blocks.1.linear2"])


def test_pattern_survives_adamw_with_weight_decay_and_names_do_not_change():
    model, _ = tiny_model()
    names = list(model.state_dict())
    keeper = SparsityKeeper(model, compute_masks(model, "magnitude"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    keeper.attach(opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(3):
        x = torch.randint(0, 4096, (2, 16))
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    keeper.check()
    assert list(model.state_dict()) == names
    assert keeper.sparsity() == pytest.approx(0.5)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert "blocks.0.linear1.weight" in changed
    # the kept positions are exactly the initial mask: nothing revived, nothing extra dropped
    for name, mask in keeper.masks.items():
        w = model.get_parameter(f"{name}.weight")
        assert torch.equal(w != 0, mask)
    # masks of a resumed run come back from the zeros
    again = masks_from_weights(model)
    assert all(torch.equal(again[k], keeper.masks[k]) for k in again)
    keeper.detach()


def test_masks_from_dense_weights_are_refused():
    model, _ = tiny_model()
    with pytest.raises(Exception, match="not 2:4 sparse"):
        masks_from_weights(model)


def test_no_sparse_kernel_on_cpu():
    model, _ = tiny_model()
    SparsityKeeper(model, compute_masks(model, "magnitude")).apply()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CPU refusal is not what runs")
    with pytest.raises(Exception, match="CUDA"):
        to_semi_structured(model)
