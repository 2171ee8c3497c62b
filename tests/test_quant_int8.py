"""The real INT8 model: exact kernels (each path forced, the automatic choice), conversion quality,
checkpoints, fallback path, bytes."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from gf_testutil import tiny_config, tiny_model
from gptforge.compress.int8_convert import compare_logits, convert_checkpoint, state_bytes
from gptforge.compress.ptq import calibrate
from gptforge.config.schema import QuantizationConfig
from gptforge.errors import ConfigError, UsageError
from gptforge.model import build_model
from gptforge.transforms import cpu_kernels
from gptforge.transforms import int8 as int8_mod
from gptforge.transforms.int8 import (
    Int8Embedding,
    Int8Linear,
    convert_model,
    fast_kernel_available,
    set_kernel,
)
from gptforge.transforms.quant import QuantLinear, quantize_model

fast = pytest.mark.skipif(not fast_kernel_available(), reason="fbgemm int8 kernels need an x86 CPU build")


def Q(**kw) -> QuantizationConfig:
    return QuantizationConfig(enable=True, **kw)


def _trained_layer(in_f=96, out_f=40, **kw) -> QuantLinear:
    torch.manual_seed(3)
    m = QuantLinear.from_linear(nn.Linear(in_f, out_f), Q(pact_init=2.5, **kw))
    m.train()
    for k in range(3):
        m(torch.randn(6, in_f) * (1 + k))
    return m.eval()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("pact", [None, "PACT"])
@pytest.mark.parametrize("atype", ["moving_average_abs_max", "abs_max"])
@pytest.mark.parametrize("wtype", ["abs_max", "channel_wise_abs_max"])
def test_int8_linear_equals_the_fake_quant_layer(wtype, atype, pact, bits):
    fq = _trained_layer(weight_quantize_type=wtype, activation_quantize_type=atype, activation_preprocess_type=pact,
                        weight_bits=bits)
    q = Int8Linear.from_quant(fq)
    assert q.weight.dtype == torch.int8 and int(q.weight.abs().max()) == 2 ** (bits - 1) - 1
    x = torch.randn(3, 7, 96) * 2
    with torch.no_grad():
        want, got = fq(x), q(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.fixture(autouse=True)
def _no_forced_kernel(monkeypatch):
    monkeypatch.delenv(cpu_kernels.KERNEL_ENV, raising=False)


def _saturating_case():
    """A layer and an input whose byte pairs (255 x 127) overflow int16 pair sums, with the
    exact int8 arithmetic of the same integers in float64."""
    K, N = 256, 4
    w = torch.full((N, K), 1.0)
    w[1] = -1.0
    w[2, ::2] = 0.5
    fq = QuantLinear.from_linear(nn.Linear(K, N, bias=False), Q(activation_quantize_type="abs_max"))
    with torch.no_grad():
        fq.weight.copy_(w)
    q = Int8Linear.from_quant(fq.eval())
    x = torch.full((2, K), 3.0)
    x[1, ::3] = -3.0
    exact = (np.round(x.numpy() / (3.0 / 127)) @ np.round(w.numpy() / np.abs(w.numpy()).max(1, keepdims=True) * 127).T)
    exact = exact * (3.0 / 127) * (np.abs(w.numpy()).max(1) / 127)
    return q, x, exact


def _plain_call(q, x):
    """fbgemm's one call with zero point 128, straight from torch.ops (not through our layer)."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, 3.0 / 127, 128, q.packed())


@pytest.fixture
def native_int8():
    """Skips where gptforge's int8 kernel has no vector path. Asked at run time, not at collection:
    asking builds the kernels, which must go to the session's cache (conftest), not the user's."""
    if not int8_mod.native_ready():
        pytest.skip("gptforge's CPU kernels run no vector path here")


@fast
@pytest.mark.parametrize("how", ["argument", "environment"])
@pytest.mark.parametrize("kernel", ["split", "plain", "native"])
def test_forced_kernel_runs_that_path_and_is_exact_iff_the_probe_says_so(kernel, how, monkeypatch, request):
    if kernel == "native":
        request.getfixturevalue("native_int8")
    q, x, exact = _saturating_case()
    if how == "argument":
        monkeypatch.setenv(cpu_kernels.KERNEL_ENV, "split" if kernel == "plain" else "plain")  # the argument wins
        set_kernel(q, kernel)
    else:
        monkeypatch.setenv(cpu_kernels.KERNEL_ENV, kernel)
    calls = []
    monkeypatch.setattr(int8_mod.native_kernels, "int8_rows",
                        lambda *a, real=int8_mod.native_kernels.int8_rows: calls.append(1) or real(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # forcing plain where it saturates warns
        got = q(x).numpy()
    assert bool(calls) == (kernel == "native")
    if kernel in ("split", "native"):  # exact on any CPU
        np.testing.assert_allclose(got, exact, rtol=1e-6)
    else:  # the plain call itself, exact exactly where the probe says so
        np.testing.assert_array_equal(got, _plain_call(q, x).numpy())
        assert np.allclose(got, exact, rtol=1e-6) == bool(cpu_kernels.fbgemm_plain_is_exact())


@fast
def test_automatic_kernel_is_exact_on_this_cpu():
    q, x, exact = _saturating_case()
    want_path = "plain" if cpu_kernels.fbgemm_plain_is_exact() else "native" if int8_mod.native_ready() else "split"
    assert int8_mod.kernel_path() == want_path
    np.testing.assert_allclose(q(x).numpy(), exact, rtol=1e-6)
    emb = Int8Embedding.from_embedding(nn.Embedding(300, 256))
    h = torch.randn(5, 256) * 3
    if want_path == "native":  # one 16-bit integer per activation
        step = float(h.abs().max()) / 32767
        want = torch.round(h.double() / step) * step @ emb.dequantized_weight().double().T
    else:
        step = float(h.abs().max()) / 127
        q1 = torch.round(h.double() / step)
        q2 = torch.round((h.double() - q1 * step) * 254 / step)  # the second digit, as the head carries it
        want = (q1 * step + q2 * step / 254) @ emb.dequantized_weight().double().T
    torch.testing.assert_close(emb.project(h).double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))


@fast
def test_head_is_exact_on_the_split_path_and_equal_on_both_where_plain_is_exact():
    emb = Int8Embedding.from_embedding(nn.Embedding(300, 256))
    h = torch.randn(5, 256) * 3
    got = {}
    for kernel in ("split", "plain", *(("native",) if int8_mod.native_ready() else ())):
        set_kernel(emb, kernel)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got[kernel] = emb.project(h)
    want = h.double() @ emb.dequantized_weight().double().T  # ~16-bit activations: close to float
    torch.testing.assert_close(got["split"].double(), want, rtol=0, atol=1e-4 * float(want.abs().max()))
    if cpu_kernels.fbgemm_plain_is_exact():
        torch.testing.assert_close(got["plain"], got["split"], rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    if "native" in got:  # one 16-bit integer per activation instead of two int8 digits: as close to float
        torch.testing.assert_close(got["native"].double(), want, rtol=0, atol=1e-4 * float(want.abs().max()))
        step = float(h.abs().max()) / 32767
        q = torch.round(h.double() / torch.tensor(step, dtype=torch.float32).double())
        exact = (q @ emb.weight.double().T).float() * (torch.tensor(step, dtype=torch.float32) * emb.weight_scale)
        assert torch.equal(got["native"], exact)  # K 256: one chunk, exact int32 sums


@fast
@pytest.mark.parametrize("atype", ["moving_average_abs_max", "abs_max"])
def test_a_cpu_where_plain_is_exact_gets_plain_and_the_fake_quant_numbers(atype, monkeypatch):
    """The VNNI branch on any CPU: 4-bit weights (|w| <= 7) cannot overflow int16 pair sums
    (2 x 255 x 7), so the plain call is exact here too; a probe saying 'exact' must pick it."""
    monkeypatch.setattr(cpu_kernels, "fbgemm_plain_is_exact", lambda: True)
    calls = []
    real = int8_mod.kernel_path
    monkeypatch.setattr(int8_mod, "kernel_path", lambda k=None: calls.append(real(k)) or calls[-1])
    fq = _trained_layer(weight_bits=4, activation_quantize_type=atype, activation_preprocess_type="PACT")
    q = Int8Linear.from_quant(fq)
    x = torch.randn(3, 7, 96) * 2
    with torch.no_grad():
        want, got = fq(x), q(x)
    assert set(calls) == {"plain"}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    set_kernel(q, "split")
    torch.testing.assert_close(q(x), got, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert calls[-1] == "split"


def test_auto_follows_the_probe_and_the_environment_forces_a_path(monkeypatch):
    for exact, ready, auto in ((True, True, "plain"), (True, False, "plain"), (False, True, "native"),
                               (False, False, "split"), (None, False, "split")):  # None: no fbgemm
        monkeypatch.setattr(cpu_kernels, "fbgemm_plain_is_exact", lambda e=exact: e)
        kernel = lambda k=None, r=ready: cpu_kernels.int8_kernel(k, lambda: r)  # noqa: E731
        assert kernel() == auto and kernel("auto") == auto
        for forced in ("split", "plain", "native"):
            monkeypatch.setenv(cpu_kernels.KERNEL_ENV, forced)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want = "split" if forced == "native" and not ready else forced  # no native kernel: warned, split
                assert kernel() == want and kernel("auto") == want
                other = "plain" if forced != "plain" else "split"
                assert kernel(other) == other  # an argument beats the environment
        monkeypatch.setenv(cpu_kernels.KERNEL_ENV, "Auto ")
        assert kernel() == auto
        monkeypatch.delenv(cpu_kernels.KERNEL_ENV)
    monkeypatch.setenv(cpu_kernels.KERNEL_ENV, "fast")
    with pytest.raises(UsageError, match="GPTFORGE_INT8_KERNEL='fast': choose one of auto, split, plain, native"):
        cpu_kernels.int8_kernel()
    with pytest.raises(ConfigError, match="int8 kernel 'vnni'"):
        set_kernel(nn.Sequential(), "vnni")


def test_forcing_native_without_the_kernels_warns_and_takes_split(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "fbgemm_plain_is_exact", lambda: False)
    cpu_kernels._warn_inexact.cache_clear()
    with pytest.warns(RuntimeWarning, match="kernel=native: gptforge's CPU kernels do not run a vector path"):
        assert cpu_kernels.int8_kernel("native", lambda: False) == "split"
    monkeypatch.setenv("GPTFORGE_NATIVE_ISA", "off")
    assert not int8_mod.native_ready() and int8_mod.kernel_path() == "split"


@pytest.mark.parametrize("path", ["scalar", "avx2"])
@pytest.mark.parametrize("shape", [(37, 129, 5), (300, 768, 4), (8, 2, 1), (50, 96, 64)])
@pytest.mark.parametrize("per_channel", [True, False])
def test_native_int8_rows_equal_exact_integer_arithmetic_bit_for_bit(path, shape, per_channel, native_int8):
    """Every ISA path: round(x/step) (ties to even, ±127) times the int8 weights summed exactly, then
    float(sum) · (float(step) · w_scale) + bias, as fbgemm's one-call path scales it; odd K, N not a
    multiple of 8, 1 to 64 rows; each row's bits independent of the rows beside it."""
    n, k, m = shape
    g = torch.Generator().manual_seed(n + k + m)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w[0] = 127  # the extremes: full-range products everywhere in a row
    ws = torch.rand(n if per_channel else 1, generator=g) * 0.01 + 1e-3
    bias = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g) * 3
    x[0] = x[0].sign() * x.abs().max()  # every activation at ±127
    step = float(x.abs().max()) / 127
    q = torch.round(x.double() / torch.tensor(step, dtype=torch.float32).double()).clamp(-127, 127)
    sums = q @ w.double().T  # exact: |sum| < 2^53
    want = sums.float() * (torch.tensor(step, dtype=torch.float32) * ws) + bias
    got = int8_mod.native_kernels.int8_rows(x, int8_mod.pack_panels(w), ws, bias, step, n, path)
    assert torch.equal(got, want)
    alone = int8_mod.native_kernels.int8_rows(x[-1:], int8_mod.pack_panels(w), ws, bias, step, n, path)
    assert torch.equal(alone[0], got[-1])


@pytest.mark.parametrize("path", ["scalar", "avx2"])
def test_native_16_bit_activations_sum_in_chunks_without_overflow(path, native_int8):
    """qmax 32767 (the head): 2 x 127 x 32767 per input pair overflows an int32 lane past 258 pairs;
    K 1030 at the extremes (every product +127 x 32767) is summed in chunks, each exact, added as floats."""
    n, k = 20, 1030
    w = torch.full((n, k), 127, dtype=torch.int8)
    w[1::2] = -127
    x = torch.full((3, k), 5.0)
    x[1, ::2] = -5.0
    step = 5.0 / 32767
    q = torch.round(x.double() / torch.tensor(step, dtype=torch.float32).double()).clamp(-32767, 32767)
    sums = q @ w.double().T
    assert sums.abs().max() > 2 ** 31  # one int32 sum would overflow
    got = int8_mod.native_kernels.int8_rows(x, int8_mod.pack_panels(w), torch.ones(1), None, step, n, path, qmax=32767)
    want = sums * float(torch.tensor(step, dtype=torch.float32))
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_cpu_description_names_the_model_flags_and_probe():
    info = cpu_kernels.cpu_info()
    assert info["model"] and info["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(info["flags"]) <= set(cpu_kernels.INT8_FLAGS)
    line = cpu_kernels.describe()
    assert info["model"] in line and "fbgemm plain u8*s8" in line


def test_int8_embedding_lookup_and_two_digit_head():
    emb = nn.Embedding(300, 64)
    q = Int8Embedding.from_embedding(emb)
    deq = q.dequantized_weight()
    step = emb.weight.detach().abs().amax(1, keepdim=True) / 127
    torch.testing.assert_close(deq, torch.round(emb.weight.detach() / step) * step)
    ids = torch.tensor([[0, 5, 299]])
    torch.testing.assert_close(q(ids), deq[ids])
    h = torch.randn(2, 5, 64)
    want = h @ deq.T
    torch.testing.assert_close(q.project(h), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_fallback_path_gives_the_same_numbers(monkeypatch):
    fq = _trained_layer(activation_preprocess_type="PACT")
    q = Int8Linear.from_quant(fq)
    x = torch.randn(4, 96)
    fast_out = q(x)
    monkeypatch.setattr(int8_mod, "fast_kernel_available", lambda: False)
    torch.testing.assert_close(q(x), fast_out, rtol=1e-5, atol=1e-5)


def _qat_like(model, q, batches):
    """Fake-quant model with scales set as a few training steps would (no optimizer needed)."""
    quantize_model(model, q)
    calibrate(model, batches, "moving_average")
    return model.eval()


@pytest.mark.parametrize("embedding", ["quantized in QAT", "int8 at conversion", "float"])
def test_converted_model_matches_fake_quant_model(embedding):
    torch.manual_seed(0)
    model, _ = tiny_model()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 300, (4, 64), generator=g) for _ in range(4)]
    fq = _qat_like(model, Q(activation_preprocess_type="PACT", quantize_embedding=embedding == "quantized in QAT"),
                   batches)
    conv_model = _converted(fq, embedding != "float")
    ids = torch.randint(0, 300, (4, 64), generator=g)
    stats = compare_logits(fq, conv_model, ids)
    assert stats["sqnr_db"] >= 35.0 and stats["argmax_agreement"] >= 0.99, stats
    assert isinstance(conv_model.blocks[0].linear2, Int8Linear)
    assert isinstance(conv_model.wte, Int8Embedding) == (embedding != "float")


def _converted(fq, int8_embedding):
    m = copy.deepcopy(fq)
    convert_model(m, int8_embedding=int8_embedding)
    return m


def test_converted_checkpoint_loads_evaluates_and_dequantizes(tmp_path):
    from safetensors import safe_open

    from gptforge.model_io import load_model, save_model_dir

    torch.manual_seed(0)
    model, cfg = tiny_model()
    q = Q(weight_quantize_type="abs_max", activation_preprocess_type="PACT")
    fq = _qat_like(model, q, [torch.randint(0, 300, (2, 32)) for _ in range(3)])
    cfg.Compress.Quantization = q
    save_model_dir(fq, cfg, tmp_path / "qat")
    res = convert_checkpoint(tmp_path / "qat", tmp_path / "int8", int8_embedding=True, echo=False)
    assert res.check_data == "random ids" and res.sqnr_db >= 35 and res.int8_layers == 8
    # the report names the INT8 path its check ran on (the automatic one here) and the CPU
    path = int8_mod.kernel_path()
    auto = (f"{'gptforge' if path == 'native' else 'fbgemm'} {path}" if fast_kernel_available()
            else "dequantized fp32 (no fbgemm)")
    assert res.check_kernel == auto and cpu_kernels.cpu_info()["model"] in res.cpu
    loaded, lcfg = load_model(tmp_path / "int8")
    assert lcfg.Compress.Quantization.converted and lcfg.Compress.Quantization.quantize_embedding
    assert isinstance(loaded.blocks[1].attn.qkv_proj, Int8Linear) and isinstance(loaded.wte, Int8Embedding)
    with safe_open(str(tmp_path / "int8" / "model.safetensors"), "pt") as f:
        assert f.get_slice("blocks.0.linear1.weight").get_dtype() == "I8"
        assert f.get_slice("wte.weight").get_dtype() == "I8"
    ids = torch.randint(0, 300, (2, 20))
    torch.testing.assert_close(loaded(ids).logits, _converted(fq, True)(ids).logits, rtol=0, atol=0)
    # a KV-cached decode step works (the cache is fp32 although wte.weight is int8)
    cache = loaded.new_cache(2, 24)
    assert cache.k[0].dtype == torch.float32
    h = loaded.hidden_states(ids, cache=cache)
    step = loaded.hidden_states(ids[:, :1], cache=cache)
    assert step.shape == (2, 1, 64) and h.shape == (2, 20, 64)
    # weights only (e.g. Compress.pretrained = an INT8 model): int8 x step, the fake-quant weights
    flt, _ = load_model(tmp_path / "int8", with_structure=False)
    torch.testing.assert_close(flt.blocks[0].linear1.weight, fq.blocks[0].linear1.quantized_weight())


def test_int8_bytes_are_under_30_percent_of_fp32():
    cfg = tiny_config("Model.preset=mini")
    model = build_model(cfg.Model)
    fp32 = state_bytes(model)
    quantize_model(model, Q(quantize_embedding=True))
    calibrate(model, [torch.randint(0, 8000, (1, 16))])
    convert_model(model)
    assert isinstance(model.wte, Int8Embedding)
    assert state_bytes(model) <= 0.30 * fp32


def test_embedding_is_converted_as_it_was_trained():
    for trained in (False, True):
        model, _ = tiny_model()
        quantize_model(model, Q(quantize_embedding=trained))
        convert_model(model)
        assert isinstance(model.wte, Int8Embedding) == trained
        assert ("logits" in model.__dict__) == trained
    model, _ = tiny_model()
    quantize_model(model, Q(quantize_embedding=True))
    convert_model(model, int8_embedding=False)  # forced float: the plain embedding and head again
    assert type(model.wte) is nn.Embedding and "logits" not in model.__dict__
