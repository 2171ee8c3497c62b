"""Speculative decoding inside `gptforge serve`'s continuous batch (`-o Generation.draft=DIR`):
a real uvicorn server on a free port, the official `openai` client. Greedy results equal plain
serving and solo `generate`, with a draft equal to the target (everything accepted) and with a
different draft (partial acceptance), for several K; stops cut exactly inside an accepted run;
seeded sampling is reproducible; a draft with another tokenizer is refused in one line."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import re
import time
from collections import Counter

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from gptforge.config.schema import GenerationConfig  # noqa: E402
from gptforge.errors import ConfigError  # noqa: E402
from gptforge.generate import generate  # noqa: E402
from gptforge.generate.backend import TorchBackend  # noqa: E402
from gptforge.model_io import load_model  # noqa: E402
from serve_support import model_fixtures, serving, throttled  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "birds", "sing"]
PROMPTS = [" ".join(WORDS[: 1 + (i * 5) % len(WORDS)]) * (1 + i % 3) for i in range(8)]
LENGTHS = [3 + (i * 7) % 18 for i in range(8)]


ckpt, model, tok = model_fixtures("serve_spec")


@pytest.fixture(scope="module")
def drafts(ckpt, model):
    """{"self": the target's weights loaded again (all accepted), "other": those weights with
    noise (accepts some, rejects some), "flat": its logits times 0.3 (the same ranking, a much
    flatter distribution: sampling accepts some, rejects some)}."""
    same, _ = load_model(ckpt)
    other, flat = copy.deepcopy(model[0]), copy.deepcopy(model[0])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.03)
        flat.norm.weight.mul_(0.3)
        flat.norm.bias.mul_(0.3)
    return {"self": same, "other": other.eval(), "flat": flat.eval()}


@pytest.fixture(scope="module")
def refs(model, tok):
    """Solo `generate` greedy text of every prompt, one at a time."""
    return [generate(model[0], tok, [p], GenerationConfig(max_dec_len=n, decode_strategy="greedy_search")).texts[0][0]
            for p, n in zip(PROMPTS, LENGTHS, strict=True)]


def _gen(model, k: str):
    return dataclasses.replace(model[1].Generation, num_draft_tokens=k)


def _concurrent(server, prompts, lengths, **kw):
    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*[c.completions.create(model="tiny", prompt=p, max_tokens=n, **kw)
                                          for p, n in zip(prompts, lengths, strict=True)])
        finally:
            await c.close()

    with throttled(server.state, 0.003):  # let all arrive while the first ones still run
        return asyncio.run(main())


def _counter(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(rf"^{name}_total (\S+)$", text, re.M).group(1))


def test_plain_serving_equals_solo_generate(model, tok, refs):
    with serving(model[0], tok, model[1].Generation) as s:
        out = _concurrent(s, PROMPTS, LENGTHS, temperature=0)
    assert [r.choices[0].text for r in out] == refs


@pytest.mark.parametrize("which", ["self", "other"])
@pytest.mark.parametrize("k", ["1", "3", "auto"])
def test_concurrent_greedy_with_a_draft_equals_solo_generate(model, tok, drafts, refs, which, k):
    with serving(model[0], tok, _gen(model, k), draft=drafts[which]) as s:
        out = _concurrent(s, PROMPTS, LENGTHS, temperature=0)
        eng = s.state.engine
        assert [r.choices[0].text for r in out] == refs
        assert [r.usage.completion_tokens for r in out] == LENGTHS  # no EOS in these: usage is exact
        assert eng.peak_batch >= 4  # they really shared rounds
        assert _counter(s, "gptforge_draft_tokens") == eng.drafted > 0
        assert _counter(s, "gptforge_draft_accepted_tokens") == eng.accepted
        if which == "self":
            assert eng.accepted == eng.drafted
        else:
            assert 0 < eng.accepted < eng.drafted


@pytest.fixture(scope="module")
def spec_server(model, tok, drafts):
    with serving(model[0], tok, _gen(model, "8"), draft=drafts["self"]) as s:
        yield s


@pytest.fixture
def client(spec_server):
    return openai.OpenAI(base_url=spec_server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_stop_strings_and_max_tokens_cut_inside_an_accepted_run(model, tok, client, spec_server):
    prompt = "Once upon a time"
    ids = generate(model[0], tok, [prompt], GenerationConfig(max_dec_len=20, decode_strategy="greedy_search"))
    ref = ids.texts[0][0]
    # K=8 and a draft that is always right: rounds emit 9 tokens, so these cuts fall inside one.
    for n in (2, 7, 13):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
        want = generate(model[0], tok, [prompt], GenerationConfig(max_dec_len=n, decode_strategy="greedy_search"))
        assert r.choices[0].text == want.texts[0][0] and r.usage.completion_tokens == n
        assert r.choices[0].finish_reason == "length"
    words = ref.split()
    stop = words[len(words) // 2]
    before = spec_server.state.engine.accepted
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == ref[: ref.index(stop)] and r.choices[0].finish_reason == "stop"
    assert spec_server.state.engine.accepted - before >= 8  # the stop came out of an accepted run
    # Streaming sends the same text, and never the tokens after the stop.
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=[stop],
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_logprobs_match_plain_serving(model, tok, client):
    kw = {"model": "tiny", "prompt": "The cat sat on", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    spec = client.completions.create(**kw).choices[0].logprobs
    with serving(model[0], tok, model[1].Generation) as s:
        plain = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0).completions.create(**kw)
    plain = plain.choices[0].logprobs
    assert spec.tokens == plain.tokens
    assert spec.token_logprobs == pytest.approx(plain.token_logprobs, abs=1e-4)
    assert [sorted(t) for t in spec.top_logprobs] == [sorted(t) for t in plain.top_logprobs]


def test_seeded_sampling_with_a_draft_is_reproducible(model, tok, drafts):
    with serving(model[0], tok, _gen(model, "auto"), draft=drafts["other"]) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        body = {"model": "tiny", "prompt": "The cat sat on", "max_tokens": 16, "n": 2, "extra_body": {"top_k": 50}}
        alone = [x.text for x in c.completions.create(**body, temperature=0.9, seed=7).choices]
        # The same request again, now sharing rounds with others
        out = _concurrent(s, ["The cat sat on"] + PROMPTS[:3], [16] + LENGTHS[:3], n=2, temperature=0.9, seed=7,
                          extra_body={"top_k": 50})
        assert [x.text for x in out[0].choices] == alone
        assert alone[0] != alone[1]  # choice i samples with seed + i
        other = [x.text for x in c.completions.create(**body, temperature=0.9, seed=8).choices]
        assert other != alone
        assert 0 < s.state.engine.accepted < s.state.engine.drafted


def test_a_draft_needs_ragged_target_slots(model, tok, drafts):
    from gptforge.serve.server import ServeOptions, build_state

    with TorchBackend(model[0], use_cache=False) as be, pytest.raises(ConfigError, match="Generation.draft"):
        build_state(be, tok, _gen(model, "3"), ServeOptions(model_name="tiny"), draft=drafts["self"])


def test_cli_refuses_a_draft_with_another_tokenizer_in_one_line(run_cli, ckpt, tmp_path):
    from gf_testutil import tiny_model
    from gptforge.model_io import save_model_dir
    from test_train_support import small_tokenizer

    m, cfg = tiny_model()
    save_model_dir(m, cfg, tmp_path / "draft", tokenizer=small_tokenizer())
    code, _, err = run_cli("serve", "--ckpt", ckpt, "--port", "0", "-o", f"Generation.draft={tmp_path / 'draft'}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "tokenizer" in err and str(tmp_path / "draft") in err
    code, _, err = run_cli("serve", "--ckpt", ckpt, "--port", "0", "-o", f"Generation.draft={ckpt}",
                           "-o", "Generation.num_draft_tokens=0")
    assert code == 2 and "Generation.num_draft_tokens" in err and len(err.strip().splitlines()) == 1, err


def test_speculative_sampling_in_the_engine_follows_the_target_distribution(model, tok, drafts):
    """Chi-square over the first two tokens: the second is always a verified draft token (K=1)
    or the target's correction, so p(t1, t2) must be the target's whatever the draft proposes."""
    from scipy.stats import chisquare

    from gptforge.generate.engine import (
        EngineCore,
        EngineService,
        FinishEvent,
        Request,
        SamplingParams,
        SchedulerConfig,
        TokenEvent,
    )
    from gptforge.generate.slots import slots_for

    m, temp, top_k, n = model[0], 1.0, 3, 800
    prompt = tok.encode("The cat sat on")

    def dist(ids):
        with torch.no_grad():
            logits = m(torch.tensor([ids])).logits[0, -1].float() / temp
        v, i = logits.topk(top_k)
        return dict(zip(i.tolist(), v.softmax(-1).tolist(), strict=True))

    expected = {(a, b): pa * pb for a, pa in dist(prompt).items() for b, pb in dist(prompt + [a]).items()}
    seqs: dict[int, list[int]] = {}

    def sink(ev):
        if isinstance(ev, TokenEvent):
            seqs.setdefault(ev.index, []).append(ev.token_id)
        assert not (isinstance(ev, FinishEvent) and ev.reason == "error"), ev.error

    with TorchBackend(m) as be, TorchBackend(drafts["flat"]) as dbe:
        core = EngineCore(slots_for(be), eos_token_ids=[], vocab_limit=None, max_positions=be.max_positions,
                          tokenizer=tok, scheduler=SchedulerConfig(max_batch_size=256, max_queue=n, prefill_tokens=1024),
                          draft_slots=slots_for(dbe), num_draft_tokens="1")
        eng = EngineService(core).start()
        try:
            req = Request([prompt], SamplingParams(max_tokens=3, temperature=temp, top_k=top_k, seed=0), n, sink)
            eng.submit(req)
            deadline = time.monotonic() + 120
            while req.open and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            eng.stop()
    assert req.open == 0 and len(seqs) == n
    cells = sorted(expected)
    counts = Counter(tuple(s[:2]) for s in seqs.values())
    assert set(counts) <= set(cells)
    obs = [counts[c] for c in cells]
    exp = [expected[c] * n / sum(expected.values()) for c in cells]
    assert chisquare(obs, exp).pvalue > 1e-3, (obs, exp)
    assert 0 < eng.accepted < eng.drafted == n  # the draft is right sometimes, wrong sometimes


def test_eos_inside_an_accepted_run_ends_the_sequence_there(model, tok, drafts):
    prompt = "Once upon a time"
    ids = generate(model[0], tok, [prompt], GenerationConfig(max_dec_len=20, decode_strategy="greedy_search"))
    eos = ids.token_ids[0][0][6]  # a token greedy decoding emits 7th: make it the end-of-text token
    cut = ids.token_ids[0][0].index(eos)
    ref = generate(model[0], tok, [prompt], GenerationConfig(max_dec_len=20, decode_strategy="greedy_search",
                                                             eos_token_id=eos))
    with serving(model[0], tok, dataclasses.replace(_gen(model, "8"), eos_token_id=eos), draft=drafts["self"]) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert s.state.engine.accepted >= 8  # the EOS came inside a run of accepted tokens
    assert r.choices[0].text == ref.texts[0][0] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == cut + 1  # the EOS counts, nothing after it
