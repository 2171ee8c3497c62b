"""Speculative decoding (the engine's proposer + verifier): greedy output equals plain greedy
(batched, ragged prompts, several K), both KV slots equal a fresh prefill after every round, speculative sampling follows the
target's distribution (chi-square), drafts made by pruning and INT8 conversion, bad input."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from gf_testutil import tiny_model
from gptforge.config.schema import GenerationConfig
from gptforge.errors import ConfigError
from gptforge.generate import generate_ids
from gptforge.generate.api import check_config
from gptforge.generate.engine.spec import Speculator
from test_generate import _spread

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 300, 41, 9], [7, 1000, 12, 66, 2, 3, 4, 8, 90], [250, 251, 252], [99]]
GREEDY = GenerationConfig(decode_strategy="greedy_search", max_dec_len=24)


def _draft_of(target, layers: int = 1, noise: float = 0.0, seed: int = 3):
    """A draft that agrees with the target often but not always: its first `layers` layers,
    optionally with noise on the weights."""
    d, _ = tiny_model(f"Model.num_layers={layers}")
    d.load_state_dict({k: v for k, v in target.state_dict().items() if k in d.state_dict()})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return d.eval()


@pytest.fixture(scope="module")
def target():
    return _spread(tiny_model("Model.num_layers=3")[0], 0)


@pytest.fixture(scope="module")
def draft(target):
    return _draft_of(target, layers=3, noise=0.01)


def _decoder(target, draft, cfg, prompts=PROMPTS, eos=()):
    """(SearchOutput, SpecStats) of speculative decoding through the library API."""
    cfg = dataclasses.replace(cfg, eos_token_id=eos[0] if eos else None, pad_token_id=0)
    out = generate_ids(target, prompts, cfg, draft=draft)
    return out, out.speculative


@pytest.mark.parametrize("k", ["1", "2", "3", "5", "auto"])
def test_greedy_equals_plain_greedy_on_ragged_batches(target, draft, k):
    cfg = dataclasses.replace(GREEDY, num_draft_tokens=k)
    plain = generate_ids(target, PROMPTS, cfg)
    out, spec = _decoder(target, draft, cfg)
    assert torch.equal(out.tokens, plain.tokens)
    assert torch.equal(out.lengths, plain.lengths)
    torch.testing.assert_close(out.scores, plain.scores, rtol=1e-4, atol=1e-4)
    # the draft is useful but imperfect: some rounds accept, some reject
    assert 0.05 < spec.acceptance_rate < 1.0, spec.acceptance_rate
    if k == "auto":
        assert len(set(spec.k_history)) > 1  # K moved with the acceptance


def test_greedy_with_processors_and_eos_equals_plain(target, draft):
    plain0 = generate_ids(target, PROMPTS, GREEDY)
    eos = int(plain0.tokens[1, 6])  # a token row 1 emits mid-way: it finishes early there
    cfg = dataclasses.replace(GREEDY, num_draft_tokens="3", repetition_penalty=1.3, min_dec_len=4,
                              eos_token_id=eos, pad_token_id=0)
    plain = generate_ids(target, PROMPTS, cfg)
    out = generate_ids(target, PROMPTS, cfg, draft=draft)
    assert torch.equal(out.tokens, plain.tokens) and torch.equal(out.finished, plain.finished)
    assert bool(plain.finished.any())


def test_identical_draft_accepts_everything(target):
    cfg = dataclasses.replace(GREEDY, num_draft_tokens="4")
    out, spec = _decoder(target, copy.deepcopy(target), cfg)
    assert torch.equal(out.tokens, generate_ids(target, PROMPTS, cfg).tokens)
    assert spec.acceptance_rate == 1.0


def _fresh_keys(model, ids: list[int]):
    cache = model.new_cache(1, len(ids))
    with torch.inference_mode():
        model.hidden_states(torch.tensor([ids]), cache=cache)
    return [k[0, :, : len(ids)] for k in cache.k], [v[0, :, : len(ids)] for v in cache.v]


def _check_slot(slot, model, ids):
    """The slot's first len(ids) positions equal a fresh prefill of `ids`."""
    assert slot.length == len(ids)
    ks, vs = _fresh_keys(model, ids)
    for k, v, fk, fv in zip(slot.k, slot.v, ks, vs, strict=True):
        torch.testing.assert_close(k[0, :, : len(ids)], fk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v[0, :, : len(ids)], fv, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", ["1", "2", "3", "5"])
def test_caches_equal_a_fresh_prefill_after_every_round(target, draft, k, monkeypatch):
    """After each rollback the target's slot holds every token but the last, the draft's a
    prefix of that (it lacks the K-th draft's successor when all were kept)."""
    cfg = dataclasses.replace(GREEDY, num_draft_tokens=k, max_dec_len=20)
    seen = {"rounds": 0, "short": 0}
    real = Speculator.rollback

    def spy(s):
        real(s)
        toks = s.tokens
        _check_slot(s.slot, target, toks[:-1])
        assert len(toks) - 2 <= s.dslot.length <= len(toks) - 1
        seen["short"] += s.dslot.length == len(toks) - 2
        _check_slot(s.dslot, draft, toks[: s.dslot.length])
        seen["rounds"] += 1

    monkeypatch.setattr(Speculator, "rollback", staticmethod(spy))
    out, stats = _decoder(target, draft, cfg)
    assert torch.equal(out.tokens, generate_ids(target, PROMPTS, cfg).tokens)
    assert seen["rounds"] >= 3 and 0 < stats.accepted < stats.drafted


def test_many_rows_with_different_acceptance_equal_plain(target, draft):
    """Many rows accepting different counts in the same steps: every row equals plain greedy."""
    prompts = [[i + 1, 2 * i + 3, 7] for i in range(12)]
    cfg = dataclasses.replace(GREEDY, num_draft_tokens="5", max_dec_len=40)
    out, _ = _decoder(target, _draft_of(target, layers=1, noise=0.05), cfg, prompts)
    assert torch.equal(out.tokens, generate_ids(target, prompts, cfg).tokens)


# ------------------------------------------------------------------------------ sampling

V = 8


@pytest.fixture(scope="module")
def small_vocab_pair():
    t = _spread(tiny_model("Model.num_layers=2", "Model.vocab_size=8")[0], 5)
    d = _spread(tiny_model("Model.num_layers=1", "Model.vocab_size=8")[0], 6)
    return t, d


def _pair_counts(tokens: torch.Tensor) -> torch.Tensor:
    """Counts of (2nd, 3rd) generated token pairs: these come from speculative rounds."""
    idx = tokens[:, 1] * V + tokens[:, 2]
    return torch.bincount(idx, minlength=V * V)


@pytest.mark.parametrize("opts", [
    dict(temperature=1.5),
    dict(temperature=0.9, top_k=5, top_p=0.9, repetition_penalty=1.5),
])
def test_speculative_sampling_follows_the_target_distribution(small_vocab_pair, opts):
    from scipy.stats import chi2_contingency

    target, draft = small_vocab_pair
    n = 6000
    prompts = [[1, 2, 3]]
    cfg = GenerationConfig(decode_strategy="sampling", max_dec_len=3, num_return_sequences=n, num_draft_tokens="2",
                           seed=11, **opts)
    limit = V  # the model's vocabulary is padded to 128: ids >= 8 are masked
    direct = generate_ids(target, prompts, cfg, vocab_limit=limit)
    spec = generate_ids(target, prompts, cfg, vocab_limit=limit, draft=draft)
    draft_only = generate_ids(draft, prompts, cfg, vocab_limit=limit)
    a, b, c = _pair_counts(direct.tokens), _pair_counts(spec.tokens), _pair_counts(draft_only.tokens)
    keep = (a + b) > 0
    p_same = chi2_contingency(torch.stack([a[keep], b[keep]]).numpy())[1]
    keep = (a + c) > 0
    p_draft = chi2_contingency(torch.stack([a[keep], c[keep]]).numpy())[1]
    assert p_same > 1e-3, p_same
    assert p_draft < 1e-6, p_draft  # the test can tell a different distribution apart


# ------------------------------------------------------------------------------ drafts from compression

def test_pruned_and_int8_drafts_of_the_same_model(target):
    from gptforge.compress.ptq import calibrate
    from gptforge.config.schema import QuantizationConfig
    from gptforge.transforms.int8 import convert_model
    from gptforge.transforms.prune import apply_plan, make_plan
    from gptforge.transforms.quant import quantize_model

    heads = [torch.arange(blk.attn.qkv_proj.out_features // (3 * target.blocks[0].attn.head_dim), dtype=torch.float)
             for blk in target.blocks]
    ffn = [torch.arange(blk.linear1.out_features, dtype=torch.float) for blk in target.blocks]
    pruned = apply_plan(copy.deepcopy(target), make_plan(heads, ffn, 0.0, 0.125))
    g = torch.Generator().manual_seed(1)
    int8 = quantize_model(copy.deepcopy(target), QuantizationConfig(enable=True))
    calibrate(int8, [torch.randint(0, 300, (2, 32), generator=g) for _ in range(2)], "moving_average")
    int8_head = copy.deepcopy(int8)
    convert_model(int8.eval())
    convert_model(int8_head.eval(), int8_embedding=True)  # its LM head int8 too: a draft step with no logit rows
    cfg = dataclasses.replace(GREEDY, num_draft_tokens="4")
    plain = generate_ids(target, PROMPTS, cfg)
    rates = []
    for d in (pruned, int8, int8_head):
        out, spec = _decoder(target, d, cfg)
        assert torch.equal(out.tokens, plain.tokens)
        rates.append(spec.acceptance_rate)
    # pruning an untrained model changes it a lot; INT8 rounding barely does
    assert rates[0] > 0.0 and rates[1] > 0.6 and rates[2] > 0.5, rates


# ------------------------------------------------------------------------------ errors

def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        check_config(GenerationConfig(draft="d", num_draft_tokens="many"))
    with pytest.raises(ConfigError, match="beam_search"):
        check_config(GenerationConfig(draft="d", decode_strategy="beam_search", num_beams=2))
    with pytest.raises(ConfigError, match="use_cache"):
        check_config(GenerationConfig(draft="d", use_cache=False))


def test_tokenizer_mismatch_is_one_line_naming_both_dirs(run_cli, tmp_path):
    from gptforge.data.tokenizer import train_tokenizer
    from gptforge.model_io import save_model_dir
    from test_train_support import small_tokenizer

    model, cfg = tiny_model()
    save_model_dir(model, cfg, tmp_path / "target", tokenizer=small_tokenizer())
    other = train_tokenizer(["sphinx of black quartz, judge my vow. " * 20], vocab_size=280,
                            show_progress=False)
    save_model_dir(model, cfg, tmp_path / "draft", tokenizer=other)
    code, _, err = run_cli("generate", "--ckpt", tmp_path / "target", "--prompt", "the quick",
                           "-o", f"Generation.draft={tmp_path / 'draft'}", "-o", "Generation.max_dec_len=4")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(tmp_path / "draft") in err and str(tmp_path / "target") in err and "tokenizer" in err
    save_model_dir(model, cfg, tmp_path / "draft2", tokenizer=small_tokenizer())
    code, out, err = run_cli("generate", "--ckpt", tmp_path / "target", "--prompt", "the quick", "--no-stream",
                             "-o", f"Generation.draft={tmp_path / 'draft2'}", "-o", "Generation.max_dec_len=4",
                             "-o", "Generation.decode_strategy=greedy_search")
    assert code == 0, err
    code, out2, _ = run_cli("generate", "--ckpt", tmp_path / "target", "--prompt", "the quick", "--no-stream",
                            "-o", "Generation.max_dec_len=4", "-o", "Generation.decode_strategy=greedy_search")
    assert out == out2


def test_onnx_target_and_onnx_draft(run_cli, fp32, int8):
    """`infer` with a model-directory draft, `generate` with an ONNX (INT8) draft: the output of
    plain greedy decoding."""
    pytest.importorskip("onnxruntime")
    model_dir, onnx_dir = fp32
    _, int8_onnx = int8
    args = ["--prompt", "the quick brown fox", "--prompt", "pack my box", "--no-stream",
            "-o", "Generation.decode_strategy=greedy_search", "-o", "Generation.max_dec_len=12"]
    code, plain, err = run_cli("infer", "--onnx", onnx_dir, *args)
    assert code == 0, err
    code, spec, err = run_cli("infer", "--onnx", onnx_dir, *args, "-o", f"Generation.draft={model_dir}",
                              "-o", "Generation.num_draft_tokens=3")
    assert code == 0, err
    assert spec == plain
    code, plain, err = run_cli("generate", "--ckpt", model_dir, *args)
    assert code == 0, err
    code, spec, err = run_cli("generate", "--ckpt", model_dir, *args, "-o", f"Generation.draft={int8_onnx}",
                              "-o", "Generation.num_draft_tokens=auto")
    assert code == 0, err
    assert spec == plain
