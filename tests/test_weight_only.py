"""Weight-only int8 / int4 / bf16 layers, GPTQ, and the quantized model directory
(`gptforge quantize --weights`). References: exact integer / float64 arithmetic, and GPTQ's
direct formula from the paper (Frantar et al. 2022, eqs. 2-3: the OBQ update of W and H⁻¹,
without Cholesky or lazy batches) written here."""

from __future__ import annotations

import json

import pytest
import torch

from gptforge.compress.gptq import gptq_quantize
from gptforge.transforms import lowbit, native_kernels
from gptforge.transforms.weight_only import (
    KERNEL_ENV,
    NATIVE_CHUNKED_ROWS,
    WeightOnlyLinear,
    WeightOnlySpec,
    native_bf16,
    packed_is_exact,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _auto_kernel(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)


def test_int4_pack_round_trip_is_exact():
    q = torch.randint(-8, 8, (7, 34), dtype=torch.int8)
    packed = lowbit.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 17)
    assert torch.equal(lowbit.unpack_int4(packed), q)
    every = torch.arange(-8, 8, dtype=torch.int8).repeat(2, 2)  # every value in both nibbles
    assert torch.equal(lowbit.unpack_int4(lowbit.pack_int4(every)), every)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 0), (8, 0), (8, 32)])
def test_rtn_is_within_half_a_step(bits, group, sym):
    w = torch.randn(16, 64)
    q, s, z = lowbit.quantize_rtn(w, bits, group, sym)
    lo, hi = lowbit.qrange(bits)
    assert int(q.min()) >= lo and int(q.max()) <= hi
    err = (lowbit.dequantize(q, s, z, group) - w).abs()
    step = s.repeat_interleave(group or 64, dim=1)
    assert bool((err <= step / 2 + 1e-6).all())


CASES = [(4, 32, True), (4, 64, False), (8, 0, True), (8, 32, False), (16, 0, True)]


@pytest.mark.parametrize("awq", [False, True])
@pytest.mark.parametrize("bits,group,sym", CASES)
@pytest.mark.parametrize("kernel", ["auto", "native", "packed", "bf16", "fp32"])
def test_every_kernel_equals_the_dequantized_reference(monkeypatch, bits, group, sym, kernel, awq):
    monkeypatch.setenv(KERNEL_ENV, kernel)
    w, b = torch.randn(32, 128), torch.randn(32)
    s = torch.rand(128) + 0.5 if awq and bits < 16 else None  # AWQ: the input divided by s first
    m = WeightOnlyLinear.from_float(w, b, bits, group, sym, act_scale=s)
    x = torch.randn(2, 3, 128)  # 6 rows: within the native kernels' batch
    ref = x.double() @ m.dequantized_weight().double().T + b.double()
    if kernel == "native" and native_kernels.unavailable():
        pytest.skip(f"gptforge's native kernels are unavailable here: {native_kernels.unavailable()}")
    chosen = m.kernel_for(x.reshape(-1, 128))
    if kernel == "native":
        assert chosen == "native"  # bf16 weights too, on any CPU
    if kernel == "packed":
        if bits == 16 or (bits == 8 and (group or not sym)):
            assert chosen != "packed"  # no packed kernel for this format: the dequantized path
        elif not packed_is_exact(bits):
            pytest.skip(f"this CPU / torch build has no exact packed int{bits} kernel")
        else:
            assert chosen == "packed"
    if kernel == "bf16":
        assert chosen == "bf16"
    if kernel == "fp32":
        assert chosen == "fp32"
    y = m(x).double()
    assert y.shape == ref.shape
    if chosen == "bf16":  # activations and weights rounded to bf16 (8 bits of mantissa)
        torch.testing.assert_close(y, ref, rtol=2e-2, atol=5e-2 * float(ref.abs().mean()))
    else:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


def test_auto_kernel_follows_the_probes():
    m = WeightOnlyLinear.from_float(torch.randn(32, 64), None, 4, 32, True)
    want = "native" if not native_kernels.unavailable() else "bf16" if native_bf16() else "fp32"
    assert m.kernel_for(torch.randn(2, 64)) == want
    # past the native kernels' rows (in chunks): the dequantized path, never PyTorch's (slower) packed kernels
    assert m.kernel_for(torch.randn(NATIVE_CHUNKED_ROWS[4] + 1, 64)) == ("bf16" if native_bf16() else "fp32")


def test_bad_kernel_env_is_a_usage_error(monkeypatch):
    from gptforge.errors import UsageError

    monkeypatch.setenv(KERNEL_ENV, "fast")
    m = WeightOnlyLinear.from_float(torch.randn(32, 64), None, 8, 0, True)
    with pytest.raises(UsageError, match=KERNEL_ENV):
        m(torch.randn(1, 64))


# ----------------------------------------------------------------------- GPTQ


def _gptq_reference(W, H, bits, g, sym, damp, params=lowbit.group_params):
    """The paper's direct form: quantize column i, W[:, j>i] -= (w_i - q_i) / Hinv_ii · Hinv_ij,
    then remove i from the inverse Hessian, Hinv -= Hinv[:, i] Hinv[i, :] / Hinv_ii; a group's
    (scale, zero) = `params` of the current weights of its columns when its first column is reached."""
    W = W.double().clone()
    H = H.double().clone()
    H += damp * H.diagonal().mean() * torch.eye(H.shape[0], dtype=H.dtype)
    Hinv = torch.linalg.inv(H)
    cols = W.shape[1]
    Q = torch.zeros_like(W)
    for i in range(cols):
        if i % g == 0:
            s, z = (t.double() for t in params(W[:, i:i + g], bits, sym))
        q = (lowbit.quantize_cols(W[:, i:i + 1], s, z, bits)[:, 0] - z) * s
        Q[:, i] = q
        err = (W[:, i] - q) / Hinv[i, i]
        W[:, i + 1:] -= err[:, None] * Hinv[i, i + 1:][None, :]
        Hinv = Hinv - Hinv[:, i:i + 1] @ Hinv[i:i + 1, :] / Hinv[i, i]
    return Q


def _layer(rows=12, cols=48, n=256):
    torch.manual_seed(3)
    X = torch.randn(n, cols, dtype=torch.float64) @ torch.randn(cols, cols, dtype=torch.float64) * 0.3
    return torch.randn(rows, cols, dtype=torch.float64), X, 2 * X.T @ X / n


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_equals_the_papers_direct_formula(sym):
    W, _, H = _layer()
    q, s, z = gptq_quantize(W, H, 4, 16, sym, damp=0.01, block=32)  # lazy batches of 32 over 48 columns
    ours = lowbit.dequantize(q, s.double(), z.double(), 16, torch.float64)
    ref = _gptq_reference(W, H, 4, 16, sym, 0.01)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def _clip_params(w, bits, sym):
    """A group's grid as the clip search chooses it (one group: all of `w`'s columns)."""
    scale, zero = lowbit.clip_search(w, bits, 0, sym)
    return scale[:, 0], zero[:, 0]


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_with_clip_search_is_the_papers_formula_on_searched_grids(sym):
    W, _, H = _layer()
    W[:, 5] *= 6  # an outlier column: abs-max grids waste most of their steps on it
    q, s, z = gptq_quantize(W, H, 4, 16, sym, damp=0.01, block=32, clip=True)
    ours = lowbit.dequantize(q, s.double(), z.double(), 16, torch.float64)
    torch.testing.assert_close(ours, _gptq_reference(W, H, 4, 16, sym, 0.01, _clip_params), rtol=0, atol=1e-5)
    absmax = lowbit.dequantize(*gptq_quantize(W, H, 4, 16, sym, damp=0.01, block=32), 16, torch.float64)
    assert not torch.equal(ours, absmax)  # the search chose other grids somewhere


@pytest.mark.parametrize("sym", [True, False])
def test_rtn_with_clip_search_rounds_on_the_searched_grid(sym):
    torch.manual_seed(5)
    w = torch.randn(16, 128) * torch.rand(16, 128).pow(4) * 3  # heavy tails, as trained weights have
    q, s, z = lowbit.quantize_rtn(w, 4, 32, sym, clip=True)
    ss, sz = lowbit.clip_search(w, 4, 32, sym)
    assert torch.equal(s, ss) and torch.equal(z, sz)
    assert torch.equal(q.float().reshape(16, 4, 32), lowbit.quantize_cols(w.reshape(64, 32), ss.reshape(-1),
                                                                           sz.reshape(-1), 4).reshape(16, 4, 32))
    err = (lowbit.dequantize(q, s, z, 32) - w).square().sum()
    plain = (lowbit.dequantize(*lowbit.quantize_rtn(w, 4, 32, sym), 32) - w).square().sum()
    assert err < plain  # never worse per group (ratio 1 is abs-max), better on these tails


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_is_at_most_rtn(act_order):
    W, X, H = _layer()
    W, X, H = W.float(), X.float(), H.float()
    q, s, z = gptq_quantize(W, H, 4, 16, True, act_order=act_order)
    rq, rs, rz = lowbit.quantize_rtn(W, 4, 16, True)
    e_gptq = (X @ (lowbit.dequantize(q, s, z, 16) - W).T).pow(2).mean()
    e_rtn = (X @ (lowbit.dequantize(rq, rs, rz, 16) - W).T).pow(2).mean()
    assert e_gptq <= e_rtn


def test_gptq_dampens_the_tied_head_more_in_quantize_and_analyze(monkeypatch):
    """The tied head's Hessian sees only its output use (gptq.HEAD_DAMP): the quantizer, the analysis'
    rows and its head-row ladder round the head with the stronger dampening, block Linears with --damp."""
    from gf_testutil import tiny_model
    from gptforge.compress import gptq
    from gptforge.compress import sensitivity_weights as sw

    seen = []
    real = gptq.gptq_quantize

    def spy(W, H, bits, group_size=0, sym=True, damp=0.01, **kw):
        seen.append((tuple(W.shape), damp))
        return real(W, H, bits, group_size, sym, damp=damp, **kw)

    monkeypatch.setattr(gptq, "gptq_quantize", spy)
    monkeypatch.setattr(sw, "gptq_quantize", spy)
    torch.manual_seed(0)
    model, _ = tiny_model()
    head = tuple(model.wte.weight.shape)
    spec = WeightOnlySpec(bits=4, group_size=32, head_bits=4, method="gptq")
    windows = [torch.randint(0, head[0], (1, 17)) for _ in range(2)]
    sw.weight_sensitivity(model, spec, sw.calibration_batches(windows), method="gptq", damp=0.02)
    assert gptq.HEAD_DAMP > 0.02
    analysed = list(seen)  # 4 and 8 bits per layer, then the ladder's 4 and 8
    assert [d for s, d in analysed if s == head] == [gptq.HEAD_DAMP] * 4
    assert {d for s, d in analysed if s != head} == {0.02} and len(analysed) == 2 * (4 * len(model.blocks) + 2)
    seen.clear()
    gptq.gptq_model(model, spec, [w[:, :-1] for w in windows], damp=0.02, progress=False)
    assert seen[-1] == (head, gptq.HEAD_DAMP) and {d for _, d in seen[:-1]} == {0.02}
    assert gptq.damp_for("wte", 2.0) == 2.0  # a larger --damp holds for the head too


def test_awq_search_never_loses_to_rtn_and_wins_on_outlier_channels():
    from gptforge.compress.awq import awq_scale

    torch.manual_seed(5)
    X = torch.randn(512, 64)
    X[:, :4] *= 30  # a few salient input channels, as in the paper's observation
    W = torch.randn(24, 64)
    s, err, rtn = awq_scale(W, X, 4, 32, True)
    assert err <= rtn
    assert err < 0.8 * rtn
    assert bool((s[:4] > s[4:].max()).all())  # the salient channels got the larger scales
    s_flat, err_flat, rtn_flat = awq_scale(W, torch.randn(512, 64), 4, 32, True)
    assert err_flat <= rtn_flat


# ----------------------------------------------------------------------- model directories


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    from gf_testutil import tiny_model
    from gptforge.model_io import save_model_dir
    from test_train_support import small_tokenizer

    torch.manual_seed(0)
    m, cfg = tiny_model()
    d = tmp_path_factory.mktemp("wo") / "float"
    save_model_dir(m, cfg, d, small_tokenizer())
    text = d.parent / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog and runs far away. " * 60)
    return d, text


@pytest.mark.parametrize("args", [("int4", "--method", "gptq", "--asym"), ("int4", "--method", "gptq", "--clip-search"),
                                  ("int8", "--head-bits", "4"),
                                  ("bf16", "--head-bits", "16"), ("int4", "--method", "awq", "--head-bits", "32")])
def test_quantized_directory_loads_and_generates(run_cli, float_dir, tmp_path, args):
    from gf_testutil import assert_close_for_kernels, chosen_kernels
    from gptforge.model_io import load_model
    from gptforge.transforms.weight_only import weight_only_layers

    src, text = float_dir
    out = tmp_path / "q"
    code, stdout, err = run_cli("quantize", "--ckpt", src, "--out", out, "--weights", *args, "--calib", text,
                                "--samples", "4", "--seq-len", "32", "--group-size", "32" if args[0] != "bf16" else "0")
    assert code == 0, err
    assert "gptforge quantize: weights" in stdout
    q, _ = load_model(out)
    f, _ = load_model(src)
    assert len(weight_only_layers(q)) == 4 * 2 + (1 if "32" not in args else 0)
    assert ("awq" in args) == hasattr(q.blocks[0].linear1, "act_scale")
    # GPTQ's head dampening is on record where GPTQ rounded the head
    assert json.loads((out / "weight_only.json").read_text())["head_damp"] == (0.5 if "gptq" in args else None)
    assert json.loads((out / "weight_only.json").read_text())["clip"] is ("--clip-search" in args)
    assert ("clip-searched grids" in stdout) is ("--clip-search" in args)
    ids = torch.randint(0, 4096, (2, 16))
    lq, lf = q(ids).logits, f(ids).logits
    rel = float((lq - lf).detach().norm() / lf.detach().norm())
    assert rel < {"int4": 0.3, "int8": 0.3, "bf16": 0.05}[args[0]]
    plain, _ = load_model(out, with_structure=False)  # float weights of the quantized model
    assert_close_for_kernels(lq, plain(ids).logits, chosen_kernels(q, ids.numel()), 1e-3)
    code, stdout, err = run_cli("generate", "--ckpt", out, "--prompt", "the quick", "-o",
                                "Generation.decode_strategy=greedy_search", "-o", "Generation.max_dec_len=4",
                                "--no-stream")
    assert code == 0, err
    assert stdout.startswith("the quick")
    code, stdout, err = run_cli("quantize", "--ckpt", out)  # the per-layer table
    assert code == 0, err
    assert "blocks.1.linear2" in stdout and ("bf16" if args[0] == "bf16" else f"int{args[0][-1]}") in stdout


@pytest.mark.parametrize("extra,needle", [
    (("--weights", "int4", "--convert"), "--convert"),
    (("--weights", "int4"), "--out"),
    (("--weights", "bf16", "--group-size", "32", "--out", "X"), "bf16"),
    (("--weights", "int4", "--damp", "2", "--out", "X"), "--damp"),
    (("--weights", "int4", "--method", "awq", "--act-order", "--out", "X"), "--act-order"),
    (("--asym", "--convert", "--out", "X"), "--asym"),
    (("--weights", "int4", "--method", "gptq", "--calib", "MISSING", "--out", "X"), "--calib"),
    (("--weights", "bf16", "--clip-search", "--out", "X"), "--clip-search"),
    (("--clip-search", "--convert", "--out", "X"), "--clip-search"),
])
def test_bad_flags_are_one_line_errors(run_cli, float_dir, tmp_path, extra, needle):
    src, _ = float_dir
    extra = tuple(str(tmp_path / "o") if a == "X" else str(tmp_path / "missing.txt") if a == "MISSING" else a
                  for a in extra)
    code, _, err = run_cli("quantize", "--ckpt", src, *extra)
    assert code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_group_size_that_does_not_divide_is_a_config_error(float_dir):
    from gptforge.errors import ConfigError
    from gptforge.model_io import load_model
    from gptforge.transforms.weight_only import quantize_rtn_model

    m, _ = load_model(float_dir[0])
    with pytest.raises(ConfigError, match="--group-size 128"):
        quantize_rtn_model(m, WeightOnlySpec(bits=4, group_size=128))
