"""ONNX and torch.export step programs: fp32 parity through the KV cache, INT8 QDQ with the
learned scales and onnxruntime's int8 GEMMs, `.pt2` reload, and the INT8 kernel choice (each
branch forced, the automatic one exact on the running CPU)."""

from __future__ import annotations

import copy
from dataclasses import asdict

import numpy as np
import pytest
import torch

from gptforge.export.step import cached_logits, teacher_forced_logits
from gptforge.model_io import load_model
from test_export_support import pruned_model, qat_model

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


pytestmark = pytest.mark.usefixtures("one_thread")


def _session(onnx_dir, **kw):
    from gptforge.export.common import read_export_dir
    from gptforge.export.ort_session import make_session, session_runner

    _, meta = read_export_dir(onnx_dir, "onnx")
    sess, mode = make_session(onnx_dir / "model.onnx", meta, **kw)
    return session_runner(sess, meta["inputs"]), meta, mode


def _batch(rows=3, T=40, seed=5):
    return torch.randint(0, 300, (rows, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_fp32_onnx_equals_pytorch_through_the_kv_cache(fp32):
    src, out = fp32
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert dims["input_ids"] == ["batch", "seq"] and dims["attention_mask"] == ["batch", "total"]
    assert dims["past_key_1"] == ["batch", 2, "past", 16]  # the pruned layer's 2 heads
    assert [o.name for o in graph.output][:3] == ["logits", "present_key_0", "present_value_0"]

    run, meta, mode = _session(out)
    assert meta["precision"] == "fp32" and meta["layer_heads"] == [4, 2] and mode == "n/a"
    assert meta["check"]["max_abs_diff"] <= 1e-4
    model, _ = load_model(src)
    ids = _batch()
    got = teacher_forced_logits(run, meta["layer_heads"], meta["head_dim"], ids, prompt_len=30)  # + 10 steps
    want = model(ids).logits  # one plain forward, no cache
    assert (got - want).abs().max() <= 1e-4
    assert float(want.abs().max()) > 1.0  # the tolerance is not vacuous


@torch.no_grad()
def test_int8_qdq_onnx_has_the_learned_scales_and_agrees_with_fake_quant(int8, tmp_path, monkeypatch):
    from onnx import numpy_helper

    from gptforge.transforms.quant import quant_modules

    src, out = int8
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    proto = onnx.load(str(out / "model.onnx"))
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("QuantizeLinear") == 8 and ops.count("DequantizeLinear") == 16  # 8 Linears: x and W
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    fq, _ = load_model(src)
    steps = [float(v) for v in inits.values() if v.dtype == np.float32 and v.ndim == 0]
    for name, mod in quant_modules(fq).items():  # every learned activation step is in the graph
        want = float(mod.act_scale) / 127
        assert any(abs(s - want) <= 1e-6 * want for s in steps), name
    w = inits["model.blocks.0.linear1.weight"]
    assert w.dtype == np.uint8 and w.shape == (64, 256) and w.min() >= 1  # int8 ±127 stored + 128

    # onnxruntime's graph optimizer fuses the QDQ MatMuls into int8 GEMMs (the kernel is chosen later)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(str(out / "model.onnx"), so, providers=["CPUExecutionProvider"])
    fused = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert fused.count("MatMulIntegerToFloat") == 8

    from gptforge.transforms.cpu_kernels import ORT_GEMM_ENV, ort_gemm_is_exact

    monkeypatch.delenv(ORT_GEMM_ENV, raising=False)
    run, meta, mode = _session(out)
    assert meta["precision"] == "int8" and meta["qdq_dtype"] == "uint8"
    assert mode == ("on" if ort_gemm_is_exact("uint8") else "off")  # the automatic choice
    ids = _batch(rows=8, T=48)
    got = teacher_forced_logits(run, meta["layer_heads"], meta["head_dim"], ids, prompt_len=40)
    want = fq(ids).logits  # the fake-quant PyTorch model
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert agree >= 0.99, agree
    # Close, not only in argmax: most positions equal; elsewhere fp32 summation order moved an
    # activation by one step, as the fake-quant model itself moves when run in fp64.
    diff = (got - want).abs().amax(-1)
    floor = (copy.deepcopy(fq).double()(ids).logits - want).abs().max()
    assert float((diff <= 1e-4).float().mean()) >= 0.5 and diff.max() <= 1.5 * floor + 1e-4


@torch.no_grad()
def test_qdq_module_equals_the_fake_quant_model_in_both_encodings():
    from gptforge.export.qdq import to_qdq
    from gptforge.transforms.int8 import convert_model

    fq, _ = qat_model("Compress.Quantization.quantize_embedding=true", "Compress.Quantization.weight_quantize_type=abs_max")
    ids = _batch()
    want = fq(ids).logits
    int8 = copy.deepcopy(fq)
    convert_model(int8)
    for source in (fq, int8):
        for dtype in ("uint8", "int8"):
            got = to_qdq(source, dtype)(ids).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _one_linear_error(tmp_path, dtype: str, int8_gemm: str, wmax: int = 127) -> tuple[float, str]:
    """(largest error / largest output against exact int8 arithmetic, the mode used) of one
    Linear with weights in ±wmax and full-range activations in onnxruntime, stored as `dtype`,
    through `make_session`."""
    from gptforge.export.ort_session import make_session
    from gptforge.transforms.cpu_kernels import one_linear_qdq_graph

    rng = np.random.default_rng(0)
    w = rng.integers(-wmax, wmax + 1, (256, 64)).astype(np.int8)
    ws, step = (rng.random(64).astype(np.float32) * 0.01 + 0.001), 0.05
    xq = rng.integers(-127, 128, (8, 256)).astype(np.float64)  # full-range activations, away from rounding ties
    x = ((xq + rng.uniform(-0.4, 0.4, xq.shape)) * step).astype(np.float32)
    exact = (xq @ w.astype(np.float64)) * step * ws
    path = tmp_path / f"{dtype}.onnx"
    path.write_bytes(one_linear_qdq_graph(w, ws, step, dtype))
    sess, mode = make_session(path, {"precision": "int8", "qdq_dtype": dtype}, int8_gemm=int8_gemm)
    return float(np.abs(sess.run(None, {"x": x})[0] - exact).max() / np.abs(exact).max()), mode


@pytest.fixture
def no_forced_gemm(monkeypatch):
    from gptforge.transforms.cpu_kernels import ORT_GEMM_ENV

    monkeypatch.delenv(ORT_GEMM_ENV, raising=False)


@pytest.mark.usefixtures("no_forced_gemm")
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("int8_gemm", ["on", "off"])
def test_forced_int8_gemm_is_exact_unfused_and_fused_iff_the_probe_says_so(tmp_path, dtype, int8_gemm):
    from gptforge.transforms.cpu_kernels import ort_gemm_is_exact

    err, mode = _one_linear_error(tmp_path, dtype, int8_gemm)
    assert mode == int8_gemm
    if int8_gemm == "off" or ort_gemm_is_exact(dtype):
        assert err < 1e-5, err
    else:  # the fused kernel of this storage saturates here (int16 pair sums): far off, not rounding
        assert err > 1e-2, err


@pytest.mark.usefixtures("no_forced_gemm")
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_automatic_int8_gemm_is_exact_on_this_cpu(tmp_path, dtype):
    from gptforge.transforms.cpu_kernels import ort_gemm_is_exact

    err, mode = _one_linear_error(tmp_path, dtype, "auto")
    assert err < 1e-5 and mode == ("on" if ort_gemm_is_exact(dtype) else "off")


@pytest.mark.usefixtures("no_forced_gemm")
def test_a_cpu_where_the_s8_kernel_is_exact_fuses_int8_storage(tmp_path, monkeypatch):
    """The VNNI branch on any CPU: weights in ±7 cannot overflow int16 pair sums (2 x 255 x 7),
    so the fused s8 kernel is exact here too; a probe saying 'exact' must fuse it."""
    from gptforge.transforms import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "ort_gemm_is_exact", lambda d: True)
    err, mode = _one_linear_error(tmp_path, "int8", "auto", wmax=7)
    assert mode == "on" and err < 1e-5, err


def test_int8_gemm_and_storage_choice_follow_the_probe_and_can_be_forced(monkeypatch):
    from gptforge.errors import UsageError
    from gptforge.export.ort_session import int8_gemm_mode
    from gptforge.export.qdq import resolve_qdq_dtype
    from gptforge.transforms import cpu_kernels

    monkeypatch.delenv(cpu_kernels.ORT_GEMM_ENV, raising=False)
    meta = {"precision": "int8", "qdq_dtype": "int8"}
    for s8_exact in (True, False):
        monkeypatch.setattr(cpu_kernels, "ort_gemm_is_exact", lambda d, e=s8_exact: d == "uint8" or e)
        assert int8_gemm_mode(meta) == ("on" if s8_exact else "off")
        assert int8_gemm_mode({**meta, "qdq_dtype": "uint8"}) == "on"
        assert resolve_qdq_dtype("auto") == ("int8" if s8_exact else "uint8")
        assert resolve_qdq_dtype("uint8") == "uint8" and resolve_qdq_dtype("int8") == "int8"
        for forced in ("on", "off"):
            monkeypatch.setenv(cpu_kernels.ORT_GEMM_ENV, forced)
            assert int8_gemm_mode(meta) == forced and int8_gemm_mode(meta, "auto") == forced
            assert int8_gemm_mode(meta, "off" if forced == "on" else "on") != forced  # the argument wins
        monkeypatch.delenv(cpu_kernels.ORT_GEMM_ENV)
    monkeypatch.setattr(cpu_kernels, "ort_gemm_is_exact", lambda d: False)  # even u8·u8 inexact: unfuse
    assert int8_gemm_mode({**meta, "qdq_dtype": "uint8"}) == "off"
    assert int8_gemm_mode({"precision": "fp32"}) == "n/a"
    with pytest.raises(UsageError, match="--int8-gemm 'yes'"):
        int8_gemm_mode(meta, "yes")
    monkeypatch.setenv(cpu_kernels.ORT_GEMM_ENV, "fused")
    with pytest.raises(UsageError, match="GPTFORGE_ORT_INT8_GEMM='fused'"):
        int8_gemm_mode(meta)
    with pytest.raises(UsageError, match="--qdq-dtype 'u8'"):
        resolve_qdq_dtype("u8")


@torch.no_grad()
def test_torch_export_reloads_and_equals_eager(tmp_path):
    from gptforge.export import export_torch, load_program
    from gptforge.export.program import graph_model
    from gptforge.export.step import layer_heads

    ids = _batch(rows=2, T=24)
    for name, (model, cfg) in (("fp32", pruned_model()), ("int8", qat_model())):
        r = export_torch(model, tmp_path / name, cfg=cfg)
        assert r.precision == name and r.check["positions"] > 0
        ep, meta = load_program(tmp_path / name)
        assert meta["format"] == "torch" and meta["precision"] == name
        prog = ep.module()
        got = teacher_forced_logits(lambda xs, p=prog: list(p(*xs)), layer_heads(model), 16, ids, prompt_len=16)
        eager = graph_model(model, name)  # the fp32 model itself, or its QDQ (fake-quant numerics) form
        assert (got - cached_logits(eager, ids, 16)).abs().max() <= 1e-5
    assert asdict(r)["format"] == "torch"
    with pytest.raises(Exception, match="holds a 'torch' export, not onnx"):
        from gptforge.export.common import read_export_dir

        read_export_dir(tmp_path / "int8", "onnx")


def test_check_verdicts():
    from gptforge.errors import CheckpointError
    from gptforge.export.program import verdict

    verdict({"max_abs_diff": 9e-4, "max_abs_logit": 10.0}, "fp32")  # 1e-4 relative to the logits' size
    with pytest.raises(CheckpointError, match="differ from PyTorch by 0.0011"):
        verdict({"max_abs_diff": 1.1e-3, "max_abs_logit": 10.0}, "fp32")
    verdict({"argmax_agreement": 0.99}, "int8")
    with pytest.raises(CheckpointError, match="98.0% of greedy tokens"):
        verdict({"argmax_agreement": 0.98}, "int8")
    # below 99%: as close to exact (fp64) arithmetic as the PyTorch model itself, within 3 points
    verdict({"argmax_agreement": 0.92, "fp64_agreement": {"export": 0.91, "pytorch": 0.93}}, "int8")
    with pytest.raises(CheckpointError, match="the export agrees on 85.0%, PyTorch on 93.0%"):
        verdict({"argmax_agreement": 0.9, "fp64_agreement": {"export": 0.85, "pytorch": 0.93}}, "int8")


def test_the_probe_graph_runs_on_an_onnxruntime_older_than_onnx():
    """The one-Linear probe states opset 18's IR version (8), not the installed `onnx`'s newest: onnx
    1.23 writes IR 14, which onnxruntime 1.30 refuses (seen on a lent machine: `describe()` raised)."""
    import onnx

    from gptforge.transforms.cpu_kernels import one_linear_qdq_graph

    model = onnx.load_from_string(one_linear_qdq_graph(np.ones((4, 2), np.int8), np.ones(2, np.float32), 1.0, "int8"))
    assert model.ir_version == 8 and model.opset_import[0].version == 18
    onnx.checker.check_model(model)
