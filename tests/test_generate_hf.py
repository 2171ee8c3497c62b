"""Generation parity with HF `transformers`: same imported weights, left-padded batches of
prompts with different lengths, greedy and beam search, logits processors and warpers."""

from __future__ import annotations

import pytest
import torch

from gptforge.config.schema import GenerationConfig
from gptforge.generate import (
    MinNewTokens,
    ProcessorList,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
    generate,
    generate_ids,
)
from gptforge.model_io import load_model

transformers = pytest.importorskip("transformers")
from transformers.generation import logits_process as hf_lp  # noqa: E402

VOCAB = 300
LENS = (5, 9, 3, 7)
MAX_NEW = 12


def _random_hf(vocab: int, seed: int = 1):
    """A random GPT-2 whose logits are spread out (no near-ties that rounding could flip)."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_head=4, n_layer=2,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF model, our import of it, prompts, EOS id that some rows emit mid-way)."""
    hf = _random_hf(VOCAB)
    path = tmp_path_factory.mktemp("hfgen") / "hf"
    hf.save_pretrained(path)
    ours, _ = load_model(path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENS]
    # EOS = a token row 0 produces greedily at step 3, so rows stop at different steps.
    probe = _hf_generate(hf, prompts, eos=VOCAB - 1, max_new_tokens=MAX_NEW, do_sample=False)
    eos = int(probe.sequences[0, max(LENS) + 3])
    return hf, ours, prompts, eos


def _hf_generate(hf, prompts, eos, **kw):
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[eos] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, pad_token_id=eos, eos_token_id=eos,
                           return_dict_in_generate=True, output_scores=True, **kw)


def test_greedy_matches_hf_with_padding_and_eos(pair):
    hf, ours, prompts, eos = pair
    ref = _hf_generate(hf, prompts, eos, max_new_tokens=MAX_NEW, do_sample=False)
    out = generate_ids(ours, prompts, GenerationConfig(decode_strategy="greedy_search", max_dec_len=MAX_NEW),
                       eos_token_id=eos)
    gen = ref.sequences[:, max(LENS):]
    assert torch.equal(out.tokens, gen[:, : out.tokens.shape[1]])
    assert out.finished.tolist() == [eos in row for row in gen.tolist()]
    assert out.finished[0] and not out.finished.all()  # some rows stop early, others run to the limit
    assert out.lengths[0] == 4


@pytest.mark.parametrize("num_beams,length_penalty,early_stopping,n_return", [
    (2, 1.0, False, 1), (3, 0.5, False, 2), (4, 2.0, True, 3), (3, -1.0, False, 3), (5, 0.0, False, 1)])
def test_beam_search_matches_hf(pair, num_beams, length_penalty, early_stopping, n_return):
    hf, ours, prompts, _ = pair
    kw = dict(max_new_tokens=MAX_NEW, do_sample=False, num_beams=num_beams, length_penalty=length_penalty,
              early_stopping=early_stopping, num_return_sequences=n_return)
    # EOS = a token the best beam of prompt 2 produces at step 2, so hypotheses end at different steps.
    eos = int(_hf_generate(hf, prompts, VOCAB - 1, **kw).sequences[n_return, max(LENS) + 2])
    ref = _hf_generate(hf, prompts, eos, **kw)
    cfg = GenerationConfig(decode_strategy="beam_search", max_dec_len=MAX_NEW, num_beams=num_beams,
                           length_penalty=length_penalty, early_stopping=early_stopping,
                           num_return_sequences=n_return)
    out = generate_ids(ours, prompts, cfg, eos_token_id=eos)
    assert torch.equal(out.tokens, ref.sequences[:, max(LENS):])
    assert torch.allclose(out.scores, ref.sequences_scores, rtol=1e-5, atol=1e-4)
    assert out.finished.any()  # EOS-ended hypotheses take part


def test_repetition_penalty_and_min_new_tokens_match_hf(pair):
    hf, ours, prompts, eos = pair
    ref = _hf_generate(hf, prompts, eos, max_new_tokens=MAX_NEW, do_sample=False, repetition_penalty=1.8,
                       min_new_tokens=6)
    cfg = GenerationConfig(decode_strategy="greedy_search", max_dec_len=MAX_NEW, repetition_penalty=1.8,
                           min_dec_len=6)
    out = generate_ids(ours, prompts, cfg, eos_token_id=eos)
    assert torch.equal(out.tokens, ref.sequences[:, max(LENS):][:, : out.tokens.shape[1]])
    plain = generate_ids(ours, prompts, GenerationConfig(decode_strategy="greedy_search", max_dec_len=MAX_NEW),
                         eos_token_id=eos)
    assert not torch.equal(out.tokens, plain.tokens)  # the settings changed the output
    # Beam search applies them to log-probabilities, as HF does.
    ref = _hf_generate(hf, prompts, eos, max_new_tokens=MAX_NEW, do_sample=False, num_beams=3,
                       repetition_penalty=1.5, min_new_tokens=4)
    cfg = GenerationConfig(decode_strategy="beam_search", num_beams=3, max_dec_len=MAX_NEW,
                           repetition_penalty=1.5, min_dec_len=4)
    out = generate_ids(ours, prompts, cfg, eos_token_id=eos)
    assert torch.equal(out.tokens, ref.sequences[:, max(LENS):])


def test_text_api_matches_hf_with_gpt2_tokenizer(tmp_path):
    from gptforge.data.tokenizer import gpt2_tokenizer

    tok = gpt2_tokenizer()
    hf = _random_hf(tok.vocab_size, seed=5)
    hf.save_pretrained(tmp_path / "hf")
    ours, _ = load_model(tmp_path / "hf")
    prompts = ["Hello, my name is", "The quick brown fox jumps over the lazy", "Paris"]
    cfg = GenerationConfig(decode_strategy="beam_search", num_beams=3, max_dec_len=8)
    res = generate(ours, tok, prompts, cfg)
    ids = [tok.encode(p) for p in prompts]
    ref = _hf_generate(hf, ids, tok.eos_token_id, max_new_tokens=8, do_sample=False, num_beams=3)
    L = max(len(i) for i in ids)
    for i, row in enumerate(ref.sequences[:, L:].tolist()):
        row = row[: row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
        assert res.token_ids[i][0] == row
        assert res.texts[i][0] == tok.decode(row)


# ------------------------------------------------------------------ processors vs HF's own


def _logits(seed: int, rows: int = 6, vocab: int = 500) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _finite_mask(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x)


@pytest.mark.parametrize("top_k,top_p,temperature", [
    (0, 0.9, 1.0), (0, 0.3, 0.7), (10, 1.0, 1.0), (1, 1.0, 1.0), (40, 0.8, 1.3), (5, 0.5, 0.5), (0, 1e-4, 1.0)])
def test_sampling_filters_match_hf_warpers(top_k, top_p, temperature):
    ours, ref = ProcessorList(), hf_lp.LogitsProcessorList()
    if temperature != 1.0:
        ours.append(Temperature(temperature))
        ref.append(hf_lp.TemperatureLogitsWarper(temperature))
    if top_k:
        ours.append(TopK(top_k))
        ref.append(hf_lp.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        ours.append(TopP(top_p))
        ref.append(hf_lp.TopPLogitsWarper(top_p))
    ids = torch.zeros(6, 3, dtype=torch.long)
    for seed in range(5):
        x = _logits(seed)
        a, b = ours(ids, x.clone()), ref(ids, x.clone())
        assert torch.equal(_finite_mask(a), _finite_mask(b))
        assert torch.allclose(a[torch.isfinite(a)], b[torch.isfinite(b)])
        # The sampling distributions agree too.
        assert torch.allclose(a.softmax(-1), b.softmax(-1), atol=1e-6)


def test_top_p_renormalises_after_top_k():
    """HF semantics: top-p sees the renormalised top-k distribution (the reference does not)."""
    x = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    out = ProcessorList([TopK(2), TopP(0.5)])(None, x.clone())
    # After top-k, probs are 4/7 and 3/7: 4/7 > 0.5, so only the first token survives.
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_repetition_penalty_matches_hf_sign_aware():
    x = _logits(7)
    ids = torch.randint(0, 500, (6, 20), generator=torch.Generator().manual_seed(1))
    ref = hf_lp.RepetitionPenaltyLogitsProcessor(1.7)(ids, x.clone())
    assert torch.allclose(RepetitionPenalty(1.7)(ids, x.clone()), ref)
    # Padding (NO_TOKEN = -1) is not penalised.
    padded = ids.clone()
    padded[:, :5] = -1
    ref2 = hf_lp.RepetitionPenaltyLogitsProcessor(1.7)(ids[:, 5:], x.clone())
    assert torch.allclose(RepetitionPenalty(1.7)(padded, x.clone()), ref2)


def test_min_new_tokens_matches_hf():
    x = _logits(2)
    for length in (8, 10, 11, 14):
        ids = torch.zeros(6, length, dtype=torch.long)
        ref = hf_lp.MinNewTokensLengthLogitsProcessor(8, 3, eos_token_id=7)(ids, x.clone())
        assert torch.equal(MinNewTokens(3, 8, [7])(ids, x.clone()), ref)
