"""A head whose most used rows stay at 8 bits (transforms/weight_only_rows.py, compress/head_rows.py).

The split head is checked against a float embedding whose rows are rounded here with the same
integer arithmetic (8 bits for the chosen rows, 4 for the others), on every kernel this CPU runs;
the row score against the KL increase measured by plain forward passes (the score claims to be
the second-order estimate of exactly that)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gptforge.errors import CheckpointError
from gptforge.transforms import lowbit, native_kernels
from gptforge.transforms.weight_only import KERNEL_ENV, WeightOnlySpec, quantize_rtn_model, read_spec

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 384


def _model():
    from gf_testutil import tiny_model

    torch.manual_seed(0)
    m, _ = tiny_model(f"Model.vocab_size={VOCAB}")
    with torch.no_grad():
        m.wte.weight.normal_(0.0, 0.3)
    return m


def _rounded(w, bits, g=32):
    q, s, z = lowbit.quantize_rtn(w, bits, g, True)
    return lowbit.dequantize(q, s, z, g)


def _reference_weight(w, rows8):
    ref = _rounded(w.float(), 4)
    ref[list(rows8)] = _rounded(w[list(rows8)].float(), 8)
    return ref


ROWS8 = tuple(sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:97].tolist()))
SPEC = WeightOnlySpec(bits=4, group_size=32, head_bits=4, head_rows8=ROWS8)


@pytest.mark.parametrize("kernel", ["fp32", "native"])
def test_split_head_computes_each_row_at_its_own_width(kernel, monkeypatch):
    if kernel == "native" and native_kernels.unavailable():
        pytest.skip(f"gptforge's kernels are unavailable here: {native_kernels.unavailable()}")
    from gf_testutil import within_fp32_rounding

    monkeypatch.setenv(KERNEL_ENV, kernel)
    m = _model()
    w = m.wte.weight.detach().clone()
    q = quantize_rtn_model(copy.deepcopy(m), SPEC)
    ref = _reference_weight(w, ROWS8)
    assert torch.equal(q.wte.rows8, torch.tensor(ROWS8))
    ids = torch.tensor([[0, ROWS8[0], ROWS8[-1], VOCAB - 1, 5, ROWS8[3]]])
    assert torch.equal(q.wte(ids), F.embedding(ids, ref))  # lookups dequantize each row exactly
    for one in (ROWS8[2], ROWS8[2] + 1):  # a decode step's single id, from either table
        assert torch.equal(q.wte(torch.tensor([[one]])), F.embedding(torch.tensor([[one]]), ref))
    for rows in (1, 3, 20):  # the native kernels take up to 8 rows, longer batches the fallback
        h = torch.randn(rows, w.shape[1])
        within_fp32_rounding(q.logits(h), h, ref, None)
    assert torch.equal(q.wte.dequantized_weight(), ref)
    # the state dict holds both tables; read back as float weights it is the rounded weight in token order
    sd = q.state_dict()
    assert {"wte.hot.weight", "wte.cold.weight"} <= set(sd) and "wte.weight" not in sd
    assert sd["wte.hot.weight"].shape == (len(ROWS8), w.shape[1]) and sd["wte.cold.weight"].dtype == torch.uint8
    assert torch.equal(SPEC.dequantize(sd)["wte.weight"], ref)


def test_split_head_spec_round_trips_and_bad_files_are_one_line_errors(tmp_path):
    from gptforge.transforms.weight_only import SPEC_FILE

    SPEC.save(tmp_path)
    text = (tmp_path / SPEC_FILE).read_text()
    assert len(text.splitlines()) < 20  # the row list is one line however long
    assert read_spec(tmp_path) == SPEC and read_spec(tmp_path).head_rows8 == ROWS8
    for bad in (dataclasses.replace(SPEC, head_rows8=ROWS8[::-1]), dataclasses.replace(SPEC, head_bits=8),
                dataclasses.replace(SPEC, head_rows8=(-1, 3))):
        bad.save(tmp_path)
        with pytest.raises(CheckpointError, match="head_rows8 must be ascending token ids of a 4-bit head"):
            read_spec(tmp_path)
    m = _model()
    with pytest.raises(CheckpointError, match=f"of a {VOCAB}-row head; the file belongs to another model"):
        dataclasses.replace(SPEC, head_rows8=(3, VOCAB)).apply(copy.deepcopy(m))


def test_gptq_rounds_each_table_as_it_rounds_the_whole_head():
    """GPTQ rounds rows independently: the split head's tables equal the rows of whole-head runs."""
    from gptforge.compress.gptq import gptq_quantize
    from gptforge.transforms.weight_only import quantize_layer

    m = _model()
    w = m.wte.weight.detach().float().clone()
    x = torch.randn(200, w.shape[1])
    H = 2 * x.T @ x / len(x)

    def rounder(wr, bits):
        return gptq_quantize(wr, H, bits, 32, True)

    quantize_layer(m, "wte", SPEC, rounder=rounder)
    ref = torch.empty_like(w)
    for bits in (4, 8):
        q, s, z = gptq_quantize(w, H, bits, 32, True)
        whole = lowbit.dequantize(q, s, z, 32)
        hot = torch.zeros(VOCAB, dtype=torch.bool)
        hot[list(ROWS8)] = True
        sel = hot if bits == 8 else ~hot
        ref[sel] = whole[sel]
    assert torch.equal(m.wte.dequantized_weight(), ref)


def test_fisher_score_is_the_kl_a_row_error_causes():
    """The row score (compress/head_rows.py: the head's part exact, the input embedding's sampled
    from the model's own next-token distribution) against the KL increase measured by forward passes
    with only that row perturbed, small enough for the second order to be all (float64)."""
    from gf_testutil import tiny_model
    from gptforge.compress.head_rows import fisher_row_scores

    torch.manual_seed(0)
    m = tiny_model(f"Model.vocab_size={VOCAB}")[0].double()
    torch.manual_seed(3)
    T = 12
    batches = [{"tokens": torch.randint(0, VOCAB, (8, T))} for _ in range(2)]
    ids = torch.cat([b["tokens"] for b in batches])
    read = ids.unique().tolist()
    rows = [read[0], read[5], read[10], *[v for v in range(VOCAB) if v not in read][:3]]
    w = m.wte.weight.detach().clone()
    E = torch.zeros_like(w)
    for v in rows:
        E[v] = torch.randn(w.shape[1], dtype=w.dtype) * 0.01 * w[v].norm()
    (score,) = fisher_row_scores(m, batches, [E], draws=24, seed=0)
    assert m.wte.weight.requires_grad and m.wte.weight.grad is None  # the model is left as it was
    assert float(score[[v for v in range(VOCAB) if v not in rows]].abs().max()) == 0.0
    with torch.no_grad():
        lp = torch.log_softmax(m(ids).logits, -1)
        for v in rows:
            m.wte.weight[v] += E[v]
            kl = (lp.exp() * (lp - torch.log_softmax(m(ids).logits, -1))).sum(-1).mean()
            m.wte.weight[v] -= E[v]
            ratio = float(score[v]) / T / float(kl)  # the score is per window of T positions; the KL per position
            # rows never read: the head's exact part alone; rows read: plus a sampled part
            assert (0.97 < ratio < 1.03) if v not in read else (0.7 < ratio < 1.3), (v, ratio)


def test_rows_are_ranked_by_token_counts_then_by_the_fisher_gain(monkeypatch):
    """`row_order` with counts: the counted tokens first, most frequent first; the rows the count
    never saw keep the order of the Fisher estimate alone; `token_counts` counts the first
    COUNT_TOKENS ids only."""
    from gptforge.compress import head_rows

    m = _model()
    torch.manual_seed(3)
    batches = [{"tokens": torch.randint(0, VOCAB, (4, 10))}]
    w = m.wte.weight.detach().clone()
    w4, w8 = _rounded(w, 4), _rounded(w, 8)
    plain = head_rows.row_order(m, batches, w, w4, w8).tolist()
    monkeypatch.setattr(head_rows, "COUNT_TOKENS", 9)
    ids = [7, 7, 7, 300, 300, 5, 300, 7, 300, 5, 5, 5, 5]  # counted: 7 x4, 300 x4, 5 x1; the tail is cut
    counts = head_rows.token_counts(ids + [-1, VOCAB + 2], VOCAB)
    assert counts.sum() == 9 and counts[7] == counts[300] == 4 and counts[5] == 1
    order = head_rows.row_order(m, batches, w, w4, w8, counts).tolist()
    assert sorted(order) == list(range(VOCAB))
    tie = sorted([7, 300], key=plain.index)  # equal counts: the Fisher order decides
    assert order[:3] == [*tie, 5]
    assert order[3:] == [v for v in plain if v not in (5, 7, 300)]
    res = head_rows.head_rows_result(torch.tensor(order), [], counts)
    assert res["score"] == head_rows.SCORE and res["counts"] == head_rows.counts_digest(counts)
    assert head_rows.counts_digest(counts) != head_rows.counts_digest(head_rows.token_counts(ids[:5], VOCAB))
