"""The screened LM head (`transforms/head_screen.py`): greedy decoding that reads no scores takes
the argmax from an int8 screen with a proven bound plus the head's own logits for the columns that
can still win. Checked against the full head computed by the head's own kernel: the bound holds
for every column, the choice (the first maximum among ties, under vocabulary / EOS masks) is the
full logits', the candidates' values are the head's bits, and the engine decodes the same tokens
with the screen on and off (issue #32)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from gf_testutil import tiny_model
from gptforge.errors import UsageError
from gptforge.generate.backend import TorchBackend, release_packed
from gptforge.generate.engine.offline import offline_engine, run_requests
from gptforge.generate.engine.params import SamplingParams
from gptforge.generate.engine.sampler import row_argmax
from gptforge.generate.processors import MinNewTokens, RepetitionPenalty, VocabLimit, argmax_mask
from gptforge.transforms import fp32_gemv, head_screen, native_kernels
from gptforge.transforms.weight_only import WeightOnlySpec, quantize_rtn_model


@pytest.fixture
def screen_runs(built):
    if not head_screen.available() or not fp32_gemv.available():
        pytest.skip("no vector path of the native kernels here")


def _fp32_head(v: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, k, generator=g) * 0.02 * (1 + torch.rand(v, 1, generator=g))
    wb = fp32_gemv.block_weight(w)
    path = native_kernels.isa()

    def full(h):
        return (native_kernels.fp32_gemv(h, wb, None, v, path) if h.shape[0] == 1
                else native_kernels.fp32_rows(h, wb, None, v, path))
    return w, full, head_screen.exact_columns(SimpleNamespace(wte=SimpleNamespace(weight=w)), (wb, path), None)


def _masked(x: torch.Tensor, masks) -> torch.Tensor:
    """The scores the sampler's processors leave: each row's forbidden columns at -inf."""
    cols = torch.arange(x.shape[1])
    out = []
    for row, (limit, banned) in zip(x, masks, strict=True):
        bad = torch.isin(cols, torch.tensor(list(banned), dtype=torch.long)) | (cols >= (limit or x.shape[1]))
        out.append(row.masked_fill(bad, float("-inf")))
    return torch.stack(out)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_the_bound_holds_for_every_column(screen_runs, scale):
    w, full, _ = _fp32_head(1000, 200, seed=1)
    screen = head_screen.build(w)
    h = torch.randn(8, 200) * scale * torch.logspace(-1, 1, 8)[:, None]
    err = (head_screen.approx_logits(h, screen).double() - full(h).double()).abs().amax(dim=1)
    bound = h.double().norm(dim=1) * screen.slack
    assert (err <= bound).all()
    assert (err > bound / 1000).all()  # a bound of the right size, not a vacuous one


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_choice_and_the_candidates_are_the_full_heads(screen_runs, rows):
    w, _, _ = _fp32_head(2000, 96)
    # Ties at the maximum (the first must win) and a near-tie one ulp-scale step apart.
    h = torch.randn(rows, 96)
    w[1500] = h[0] / h[0].norm() * 0.5
    w[700] = w[1500]
    w[300] = w[1500] * (1 - 1e-6)
    screen = head_screen.build(w)
    wb = fp32_gemv.block_weight(w)
    exact = head_screen.exact_columns(SimpleNamespace(wte=SimpleNamespace(weight=w)), (wb, native_kernels.isa()), None)
    ref = (native_kernels.fp32_gemv(h, wb, None, 2000) if rows == 1 else native_kernels.fp32_rows(h, wb, None, 2000))
    for masks in ([(None, ())] * rows, [(1800, (700, 3))] * rows, [(None, ()), (1000, ())] * (rows // 2) + [(None, (700,))] * (rows % 2)):
        out = head_screen.screened_logits(h, screen, exact, masks)
        want = _masked(ref, masks)
        assert torch.equal(row_argmax(out), row_argmax(want))
        kept = torch.isfinite(out)
        assert torch.equal(out[kept], want[kept])  # the head's own bits at every candidate
        assert kept.sum() < rows * 2000 // 10  # and only a few candidates
    assert int(row_argmax(head_screen.screened_logits(h[:1], screen, exact, [(None, ())]))[0]) == 700


def test_without_the_bound_the_screen_would_choose_wrongly(screen_runs):
    """The same screen with its error bound set to zero picks another token on some rows: the
    int8 screen alone is not exact, the bound is what makes the choice the full head's."""
    w, full, exact = _fp32_head(4000, 128, seed=3)
    screen = head_screen.build(w)
    blind = copy.copy(screen)
    blind.slack = 0.0
    wrong = 0
    for i in range(40):
        h = torch.randn(8, 128, generator=torch.Generator().manual_seed(i))
        ref = row_argmax(full(h))
        assert torch.equal(row_argmax(head_screen.screened_logits(h, screen, exact, [(None, ())] * 8)), ref)
        wrong += int((row_argmax(head_screen.screened_logits(h, blind, exact, [(None, ())] * 8)) != ref).sum())
    assert wrong > 0


def test_non_finite_or_huge_rows_fall_back(screen_runs):
    w, _, exact = _fp32_head(500, 64)
    screen = head_screen.build(w)
    h = torch.randn(2, 64)
    h[1, 5] = float("nan")
    assert head_screen.screened_logits(h, screen, exact, [(None, ())] * 2) is None
    assert head_screen.screened_logits(torch.full((1, 64), 1e37), screen, exact, [(None, ())]) is None
    assert head_screen.screened_logits(torch.randn(1, 64), screen, exact, [(0, ())]) is None  # nothing allowed
    assert head_screen.screened_logits(torch.randn(9, 64), screen, exact, [(None, ())] * 9) is None  # > MAX_ROWS
    w[3, 3] = float("inf")
    assert head_screen.build(w) is None


def test_bf16_head_columns_are_the_heads_bits(screen_runs):
    model = quantize_rtn_model(copy.deepcopy(tiny_model()[0]), WeightOnlySpec(bits=16, group_size=0, head_bits=16))
    h = torch.randn(head_screen.BF16_MAX_ROWS, model.config.hidden_size)
    exact = head_screen.exact_columns(model, None, h)
    if exact is None:
        pytest.skip("the bf16 head does not run on the native kernel here")
    full = model.logits(h)
    cols = torch.tensor([0, 5, 63, 64, 200, full.shape[1] - 1])
    assert torch.equal(exact(h, cols), full[:, cols])
    screen = head_screen.build(model.wte.weight)
    out = head_screen.screened_logits(h, screen, exact, [(None, ())] * len(h))
    assert torch.equal(row_argmax(out), row_argmax(full))
    more = torch.randn(head_screen.BF16_MAX_ROWS + 1, model.config.hidden_size)
    assert head_screen.exact_columns(model, None, more) is None  # where the screen stops paying


def test_other_heads_are_not_screened(built):
    model = quantize_rtn_model(copy.deepcopy(tiny_model()[0]), WeightOnlySpec(bits=8, group_size=0, head_bits=8))
    assert head_screen.exact_columns(model, None, torch.randn(1, model.config.hidden_size)) is None
    plain, _ = tiny_model()
    assert head_screen.exact_columns(plain, None, torch.randn(1, plain.config.hidden_size)) is None


def test_the_switch_turns_it_off(built, monkeypatch):
    monkeypatch.setenv(head_screen.ENV, "off")
    assert not head_screen.available()
    monkeypatch.setenv(head_screen.ENV, "of")  # a typo is an error naming the variable, never silently on
    with pytest.raises(UsageError, match="GPTFORGE_HEAD_SCREEN='of'"):
        head_screen.available()


def test_which_processors_leave_a_mask():
    eos = [7]
    assert argmax_mask([], 10) == (None, ())
    assert argmax_mask([VocabLimit(900), MinNewTokens(4, 10, eos)], 12) == (900, (7,))
    assert argmax_mask([VocabLimit(900), MinNewTokens(4, 10, eos)], 14) == (900, ())
    assert argmax_mask([RepetitionPenalty(1.2), VocabLimit(900)], 12) is None


def _decode(model, params, keep_scores: bool):
    from gptforge.generate.engine.sequence import Request

    with TorchBackend(model) as be:
        core = offline_engine(be, eos_token_ids=[0], vocab_limit=990, max_batch_size=4)
        g = torch.Generator().manual_seed(5)
        reqs = [Request([torch.randint(1, 990, (n,), generator=g).tolist()], params, keep_scores=keep_scores)
                for n in (3, 9, 17)]
        seqs = [s for r in reqs for s in core.add(r, bounded=False)]
        with torch.inference_mode():
            while core.has_work:
                core.step()
        head = be._head_gemv is not None
    release_packed(model)
    return [list(s.generated) for s in seqs], head


@pytest.mark.parametrize("min_tokens", [0, 12])
def test_the_engine_decodes_the_same_tokens_screened(screen_runs, monkeypatch, min_tokens):
    torch.manual_seed(0)
    model, _ = tiny_model()
    with torch.no_grad():
        model.wte.weight.normal_(0, 0.3)  # peaked and flat rows both occur
    calls = []
    real = head_screen.screened_logits
    monkeypatch.setattr(head_screen, "screened_logits", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    params = SamplingParams(max_tokens=16, temperature=0.0, min_tokens=min_tokens)
    screened, head = _decode(model, params, False)
    if not head:
        pytest.skip("no native fp32 kernels on this CPU: no screen")
    assert calls and max(calls) == 3  # the three sequences' steps (and their prefills) were screened
    n = len(calls)
    kept, _ = _decode(model, params, True)  # scores kept: the whole head, never screened
    assert len(calls) == n
    monkeypatch.setenv(head_screen.ENV, "off")
    off, _ = _decode(model, params, False)
    assert len(calls) == n
    assert screened == kept == off


def test_requests_reading_scores_are_not_screened(screen_runs, monkeypatch):
    model, _ = tiny_model()
    calls = []
    monkeypatch.setattr(head_screen, "screened_logits", lambda *a: calls.append(1))
    for params in (SamplingParams(max_tokens=4, temperature=0.0, logprobs=2),
                   SamplingParams(max_tokens=4, temperature=0.8, seed=1),
                   SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3)):
        _decode(model, params, False)
    assert calls == []
    with TorchBackend(model) as be:
        seqs = run_requests(offline_engine(be, eos_token_ids=[0], vocab_limit=None, max_batch_size=1),
                            [[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))
    release_packed(model)
    assert len(seqs[0].generated) == 3 and calls == []  # offline clients keep scores by default


def test_a_head_changed_through_data_gets_a_new_screen(screen_runs, monkeypatch):
    """A write through `.data` bumps no version counter: the screen is checked against the
    weights' content at each opening, so the next decode screens the new head, not the old one."""
    torch.manual_seed(0)
    model, _ = tiny_model()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    before, head = _decode(model, params, False)
    if not head:
        pytest.skip("no native fp32 kernels on this CPU: no screen")
    with torch.no_grad():
        model.wte.weight.data[17] *= 40.0  # token 17 now wins most steps
    after, _ = _decode(model, params, False)
    monkeypatch.setenv(head_screen.ENV, "off")
    whole, _ = _decode(model, params, False)
    assert after == whole != before


def test_speculative_verification_is_screened_and_keeps_plain_greedy(screen_runs, monkeypatch):
    """A greedy request that reads no scores has its target's verification rows (after each draft
    token) screened too: the tokens are plain greedy's."""
    torch.manual_seed(0)
    model, _ = tiny_model()
    with torch.no_grad():
        model.wte.weight.normal_(0, 0.3)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.blocks.parameters():
            p.add_(torch.randn_like(p) * 0.08)  # a draft that is sometimes wrong (7 of 30 kept here)
    calls = []
    real = head_screen.screened_logits
    monkeypatch.setattr(head_screen, "screened_logits", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    params = SamplingParams(max_tokens=20, temperature=0.0, min_tokens=20)
    prompt = [[5, 6, 7, 8, 9]]
    with TorchBackend(model) as be, TorchBackend(draft) as dbe:
        core = offline_engine(be, eos_token_ids=[0], vocab_limit=990, max_batch_size=1, draft_backend=dbe,
                              num_draft_tokens="3")
        spec = run_requests(core, prompt, params, keep_scores=False)[0].generated
        head = be._head_gemv is not None
        stats = core.stats
    release_packed(model)
    release_packed(draft)
    if not head:
        pytest.skip("no native fp32 kernels on this CPU: no screen")
    assert 4 in calls  # the last token + 3 drafts, verified in one screened call
    monkeypatch.setenv(head_screen.ENV, "off")
    with TorchBackend(model) as be:
        ref = run_requests(offline_engine(be, eos_token_ids=[0], vocab_limit=990, max_batch_size=1), prompt,
                           params)[0].generated
    release_packed(model)
    assert list(spec) == list(ref)
    assert stats.drafted > 0  # (here 7 of 30 drafts kept: both branches of the acceptance ran)
