"""`Generation.kv_cache_dtype` (model/kv_cache.py): bfloat16 and int8 KV storage. The stored round
trip stays within its bound (int8: half a scale step per element), float32 stays bit-identical
to the default, short greedy runs stay close to float32's logits, the engine's batch invariance
holds in each dtype (a served request = solo generate, bit for bit), speculative greedy = plain
greedy, the memory estimate is the real allocation, and bad values are one line."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from gf_testutil import assert_equal_if_invariant, packed_rows_invariant, tiny_model
from gptforge.config.schema import GenerationConfig
from gptforge.errors import ConfigError
from gptforge.generate import generate, generate_ids
from gptforge.generate import memory as mem
from gptforge.generate.backend import TorchBackend, as_backend
from gptforge.generate.slots import RaggedSlots
from gptforge.model.kv_cache import KVCache, dequantize_int8, quantize_int8
from test_generate import _spread
from test_serve_slots import NEW, _served
from test_speculative import _draft_of

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 300, 41, 9], [7, 1000, 12, 66, 2, 3, 4, 8, 90], [250, 251, 252], [99]]
GREEDY = GenerationConfig(decode_strategy="greedy_search", max_dec_len=24)
DTYPES = ("bfloat16", "int8")


@pytest.fixture(scope="module")
def model():
    return _spread(tiny_model("Model.num_layers=3")[0], 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model directory with GPT-2's tokenizer (the serve tests' model)."""
    from serve_support import make_ckpt

    return make_ckpt(tmp_path_factory.mktemp("kv") / "model")


def _kv(cfg: GenerationConfig, dtype: str) -> GenerationConfig:
    return dataclasses.replace(cfg, kv_cache_dtype=dtype)


# ------------------------------------------------------------------------------ storage

def test_int8_round_trip_is_within_half_a_step_per_element():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 50, 16, generator=g) * torch.logspace(-3, 2, 50)[None, None, :, None]
    x[0, 0, 0] = 0.0  # an all-zero vector: scale 0, exact zeros back
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 4, 50, 1)
    # one scale per (row, head, position): max |x| over head_dim / 127
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127, rtol=0, atol=0)
    back = dequantize_int8(q, scale, torch.float32)
    err = (x - back).abs()
    assert bool((err <= scale / 2 * (1 + 1e-6) + 1e-30).all()), float((err - scale / 2).max())
    assert torch.equal(back[0, 0, 0], torch.zeros(16))
    assert int(q.abs().max()) == 127  # the full range is used


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_cache_stores_in_its_dtype_and_reads_back_in_the_compute_dtype(dtype):
    g = torch.Generator().manual_seed(1)
    cache = KVCache([2, 3], batch_size=2, max_len=9, head_dim=8, dtype=dtype)
    ks = [torch.randn(2, h, 9, 8, generator=g) for h in (2, 3)]
    for layer, k in enumerate(ks):  # written in two pieces, like a prefill then a decode step
        cache.write(layer, 0, k[:, :, :5], -k[:, :, :5])
        cache.write(layer, 5, k[:, :, 5:], -k[:, :, 5:])
    assert cache.k[0].dtype == dtype and cache.v[1].dtype == dtype
    for layer, k in enumerate(ks):
        rk, rv = cache.read(layer, 9, torch.float32)
        assert rk.dtype == torch.float32 and rk.shape == k.shape
        if dtype == torch.bfloat16:  # round to nearest with 8 significant bits
            assert bool(((rk - k).abs() <= k.abs() * 2.0 ** -8).all())
        else:
            bound = k.abs().amax(-1, keepdim=True) / 127 / 2 * (1 + 1e-6)
            assert bool(((rk - k).abs() <= bound).all()) and bool(((rv + k).abs() <= bound).all())
    # beam search's reorder carries the int8 scales with their rows
    before = cache.read(1, 9, torch.float32)[0]
    cache.reorder(torch.tensor([1, 1, 0]))
    torch.testing.assert_close(cache.read(1, 9, torch.float32)[0], before[[1, 1, 0]], rtol=0, atol=0)


def test_float32_reads_are_views_of_the_buffer():
    cache = KVCache([2], 1, 6, 4, dtype=torch.float32)
    k = torch.randn(1, 2, 3, 4)
    rk, _ = cache.update(0, k, k)
    assert rk.data_ptr() == cache.k[0].data_ptr() and torch.equal(rk, k)


# ------------------------------------------------------------------------------ decoding

def test_float32_is_bit_identical_to_the_default(model):
    cfg = dataclasses.replace(GREEDY, pad_token_id=0)
    ref = generate_ids(model, PROMPTS, cfg)
    out = generate_ids(model, PROMPTS, _kv(cfg, "float32"))
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.scores, ref.scores)
    beam = dataclasses.replace(cfg, decode_strategy="beam_search", num_beams=3, max_dec_len=8)
    assert torch.equal(generate_ids(model, PROMPTS, _kv(beam, "float32")).tokens, generate_ids(model, PROMPTS, beam).tokens)


def _greedy_logits(model, prompt, dtype, steps=12):
    """Logits of every step of a greedy run teacher-forced on float32's tokens."""
    out = []
    with TorchBackend(model, kv_cache_dtype="float32") as ref, TorchBackend(model, kv_cache_dtype=dtype) as be:
        c_ref, c = ref.new_cache(1, len(prompt) + steps), be.new_cache(1, len(prompt) + steps)
        ids, pos = torch.tensor([prompt]), torch.arange(len(prompt))[None]
        for t in range(steps):
            a, b = ref.step(ids, pos, None, c_ref), be.step(ids, pos, None, c)
            out.append((a[0], b[0]))
            ids, pos = a.argmax(-1, keepdim=True), torch.tensor([[len(prompt) + t]])
    return out


@pytest.mark.parametrize(("dtype", "tol"), [("bfloat16", 0.03), ("int8", 0.1)])
def test_short_greedy_run_stays_close_to_float32(model, dtype, tol):
    """bfloat16 keys/values carry ~2^-9 relative error, int8 about 1/254 of each vector's largest
    entry: the logits move by a small fraction of their spread and the caches do hold the
    rounded values (the logits are not bit-equal). Measured: bfloat16 <= 0.013, int8 <= 0.04
    of the logits' standard deviation on this model with widened weights."""
    for prompt in ([5, 17, 300, 41, 9], list(range(40, 110))):
        pairs = _greedy_logits(model, prompt, dtype)
        worst = max(float((a - b).abs().max() / a.std()) for a, b in pairs)
        assert 0 < worst < tol, (dtype, worst)
        assert all(int(a.argmax()) == int(b.argmax()) for a, b in pairs)  # the same greedy tokens


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_steps_are_bit_identical_to_decoding_alone(model, dtype):
    """The engine's batch invariance in each storage dtype: a sequence's logits in a ragged step
    (random arrivals and prefill budgets) equal decoding it alone with a batch-1 cache (the
    classic attention path; the native decode attention's own invariance: test_serve_slots.py)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (1, 5, 33, 70)]
    invariant = packed_rows_invariant(model)  # bit for bit with the native kernels, or where this CPU's oneDNN is invariant
    with TorchBackend(model, kv_cache_dtype=dtype) as be:
        served = _served(RaggedSlots(be, native=False), prompts, 0)
        assert served[0]["slot"].k[0].dtype == getattr(torch, dtype)
        for p, s in zip(prompts, served, strict=True):
            cache = be.new_cache(1, len(p) + NEW)
            logits = be.step(torch.tensor([p]), torch.arange(len(p))[None], None, cache)
            for t in range(NEW):
                assert_equal_if_invariant(logits[0], s["lg"][t], invariant)
                logits = be.step(logits.argmax(-1, keepdim=True), torch.tensor([[len(p) + t]]), None, cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_speculative_greedy_equals_plain_greedy(model, dtype):
    draft = _draft_of(model, layers=3, noise=0.01)
    cfg = _kv(dataclasses.replace(GREEDY, num_draft_tokens="3", pad_token_id=0), dtype)
    plain = generate_ids(model, PROMPTS, cfg)
    out = generate_ids(model, PROMPTS, cfg, draft=draft)
    assert torch.equal(out.tokens, plain.tokens) and torch.equal(out.lengths, plain.lengths)
    assert 0 < out.speculative.accepted < out.speculative.drafted
    # and the int8 run really differs from float32 somewhere in its scores
    assert not torch.equal(plain.scores, generate_ids(model, PROMPTS, _kv(cfg, "float32")).scores)


def test_served_requests_equal_solo_generate_with_an_int8_cache(model_dir):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.model_io import load_model
    from serve_support import serving, throttled

    m, cfg = load_model(model_dir)
    tok = gpt2_tokenizer()
    gen = _kv(cfg.Generation, "int8")
    prompts = ["the quick brown fox", "a lazy dog while seven birds sing " * 3, "over", "jumps over the lazy"]
    refs = [generate(m, tok, [p], _kv(GenerationConfig(max_dec_len=9, decode_strategy="greedy_search"),
                                      "int8")).texts[0][0] for p in prompts]

    async def ask(url):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*[c.completions.create(model="tiny", prompt=p, max_tokens=9, temperature=0)
                                          for p in prompts])
        finally:
            await c.close()

    with serving(m, tok, gen) as s, throttled(s.state, 0.003):
        assert s.state.engine.slots.backend.kv_dtype == torch.int8
        out = asyncio.run(ask(s.url))
    assert [r.choices[0].text for r in out] == refs


# ------------------------------------------------------------------------------ memory, config

def test_memory_per_token_halves_and_about_quarters(model):
    heads, d = 3 * model.config.num_attention_heads, model.config.head_dim
    per = {}
    for name in ("auto", "float32", "bfloat16", "int8"):
        be = TorchBackend(model, kv_cache_dtype=name)
        per[name] = mem.kv_bytes_per_position(be)
        cache = be.new_cache(2, 7)
        tensors = cache.k + cache.v + (cache.k_scale or []) + (cache.v_scale or [])
        assert sum(t.numel() * t.element_size() for t in tensors) == per[name] * 2 * 7, name
    assert per["auto"] == per["float32"] == 2 * heads * d * 4
    assert per["bfloat16"] * 2 == per["float32"]
    assert per["int8"] == 2 * heads * (d + 4)  # int8 values + one float32 scale per head and position
    assert per["int8"] / per["float32"] == (d + 4) / (4 * d)


@pytest.mark.parametrize("bad", ["int4", "float16", ""])
def test_a_bad_value_is_one_line_naming_the_key(model, bad):
    with pytest.raises(ConfigError, match=r"^Generation.kv_cache_dtype: .* is not one of auto, float32, bfloat16, "
                                          r"int8; give e\.g\. bfloat16"):
        generate_ids(model, PROMPTS, _kv(GREEDY, bad))


def test_aliases_are_normalized(model):
    from gptforge.generate.api import check_config

    cfg = _kv(GREEDY, "BF16")
    check_config(cfg)
    assert cfg.kv_cache_dtype == "bfloat16"


def test_cli_flag_and_one_line_error(model_dir, run_cli):
    code, out, err = run_cli("config", "show", "--ckpt", model_dir, "--kv-cache-dtype", "int8")
    assert code == 0 and "kv_cache_dtype: int8" in out, err
    code, _, err = run_cli("generate", "--ckpt", model_dir, "--prompt", "hi", "--kv-cache-dtype", "int4")
    assert code == 2 and err.strip().count("\n") == 0 and "Generation.kv_cache_dtype" in err, err
    code, out, err = run_cli("generate", "--ckpt", model_dir, "--prompt", "the quick", "--max-new-tokens", "4",
                             "--kv-cache-dtype", "int8", "-o", "Generation.decode_strategy=greedy_search")
    assert code == 0, err


class _FloatOnly:
    """A StepBackend that keeps float32 arrays (as onnxruntime's does) and says nothing of dtypes."""

    device, vocab_size, max_positions = torch.device("cpu"), 10, 16

    def new_cache(self, batch_size, max_len):
        return None

    def step(self, input_ids, position_ids, attention_mask, cache):
        return torch.zeros(input_ids.shape[0], 10)

    def reorder(self, cache, index):
        return cache


def test_a_backend_without_kv_dtypes_refuses_all_but_float32():
    for ok in ("auto", "float32"):
        with as_backend(_FloatOnly(), kv_cache_dtype=ok):
            pass
    with pytest.raises(ConfigError, match=r"^Generation.kv_cache_dtype=int8: the _FloatOnly backend keeps its past "
                                          r"keys/values in float32; use float32"):
        as_backend(_FloatOnly(), kv_cache_dtype="int8")


@pytest.mark.parametrize("dtype", DTYPES)
def test_beam_search_reorders_the_compressed_cache(model, dtype, monkeypatch):
    """Beam search copies the surviving beams' caches (int8: with their scales). Reference: a
    float32 cache that stores each written key/value already rounded the way `dtype` rounds it
    (bfloat16 round trip; int8 quantize + dequantize): the same beams and scores, bit for bit."""
    cfg = GenerationConfig(decode_strategy="beam_search", num_beams=3, max_dec_len=8, pad_token_id=0)
    out = generate_ids(model, PROMPTS, _kv(cfg, dtype))
    real = KVCache.write

    def rounded(self, layer, start, k, v):
        if self.dtype == torch.float32:
            if dtype == "int8":
                k, v = (dequantize_int8(*quantize_int8(x), x.dtype) for x in (k, v))
            else:
                k, v = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
        real(self, layer, start, k, v)

    monkeypatch.setattr(KVCache, "write", rounded)
    ref = generate_ids(model, PROMPTS, _kv(cfg, "float32"))
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.scores, ref.scores)
    monkeypatch.undo()
    assert not torch.equal(generate_ids(model, PROMPTS, _kv(cfg, "float32")).scores, out.scores)


def test_onnx_infer_refuses_a_compressed_cache_and_a_pruned_model_uses_it(fp32, run_cli):
    """onnxruntime keeps float32 past arrays: `infer --kv-cache-dtype int8` is one line, exit 2;
    the pruned PyTorch model (fewer heads in some layers) decodes with an int8 cache whose
    memory estimate is its real allocation."""
    pytest.importorskip("onnxruntime")
    from gptforge.model_io import load_model

    model_dir, onnx_dir = fp32
    code, _, err = run_cli("infer", "--ckpt", onnx_dir, "--prompt", "hello", "--kv-cache-dtype", "int8")
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "Generation.kv_cache_dtype=int8: the OrtBackend backend keeps its past keys/values in float32" in err
    pruned, _ = load_model(model_dir)
    with TorchBackend(pruned, kv_cache_dtype="int8") as be:
        heads = [k.shape[1] for k in be.new_cache(1, 1).k]
        assert len(set(heads)) > 1  # really pruned per layer
        cache = be.new_cache(3, 5)
        tensors = cache.k + cache.v + cache.k_scale + cache.v_scale
        assert sum(t.numel() * t.element_size() for t in tensors) == mem.kv_bytes_per_position(be) * 3 * 5
    out = generate_ids(pruned, PROMPTS[:2], _kv(dataclasses.replace(GREEDY, max_dec_len=6, pad_token_id=0), "int8"))
    assert out.tokens.shape[0] == 2
