"""Which INT8 kernels compute exactly on the running CPU, and the path each INT8 user takes.

x86 int8 GEMMs multiply unsigned activation bytes by signed weight bytes. Without VNNI they do
it with `vpmaddubsw`, which adds two products into a *saturating* int16 (2 x 255 x 127 > 32767);
with AVX-512 VNNI / AVX-VNNI (`vpdpbusd`) the products go straight into int32 and are exact.
Which instruction a library uses is its own choice (fbgemm, onnxruntime's MLAS), so the CPU flags
are only informational: the ground truth is a one-time *probe* per kernel, an input whose pair
sums overflow int16, compared with exact integer arithmetic (cached for the process).

Paths and how to force one (an argument wins over the environment; `auto` = not forced):

- `Int8Linear` / `Int8Embedding` (`transforms/int8.py`): fbgemm's `plain` = one call with
  activation zero point 128 (u8 = q + 128), exact only where the probe says so; fbgemm's `split`
  = each row q as max(q, 0) and max(-q, 0) with zero point 0 (bytes <= 127 cannot overflow),
  exact on every CPU, for twice the rows; `native` = gptforge's own kernel
  (`csrc/int8_rows.cpp`: int16 products summed in int32, `vpmaddwd`), exact on every CPU, one
  pass per row, AVX2 or better. `auto`: `plain` where exact (VNNI: the same call on half the
  rows), else `native` where gptforge's kernels run on a vector path, else `split`. Forced:
  `kernel=` or `GPTFORGE_INT8_KERNEL=auto|split|plain|native`.
- onnxruntime, fused QDQ MatMuls (`generate/ort_backend.py`): `on` = its int8 GEMM for the
  graph's storage (u8·u8 for uint8-stored graphs, s8 for int8-stored ones), `off` = the QDQ
  graph unfused (products in fp32: exact, fp32 speed). `auto`: `on` where that kernel's probe
  is exact, else `off`. Forced: `--int8-gemm` or `GPTFORGE_ORT_INT8_GEMM=auto|on|off`.
"""

from __future__ import annotations

import functools
import os
import platform
import warnings

import numpy as np
import torch

from gptforge.errors import UsageError

KERNEL_ENV = "GPTFORGE_INT8_KERNEL"
KERNELS = ("auto", "split", "plain", "native")
ORT_GEMM_ENV = "GPTFORGE_ORT_INT8_GEMM"
ORT_GEMMS = ("auto", "on", "off")
INT8_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")
_FBGEMM_OP = "linear_with_input_q_dq_qweight_dq_output_fp32"


# ----------------------------------------------------------------------- what the CPU says


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """Model name, the INT8-relevant /proc/cpuinfo flags and torch's CPU capability (informational)."""
    name, flags = "", []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = val.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = val.split()
                if name and flags:
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    return {"model": name, "machine": platform.machine(), "flags": [f for f in INT8_FLAGS if f in flags],
            "torch_capability": torch.backends.cpu.get_cpu_capability()}


def describe(onnxruntime: bool = True) -> str:
    """One line for logs and benchmark records: CPU, flags, and what the probes found
    (onnxruntime's too unless `onnxruntime=False`)."""
    info = cpu_info()
    probes = ort_probes() if onnxruntime else {}
    ort = ", ".join(f"onnxruntime {d} storage fused {'exact' if e else 'inexact'}" for d, e in probes.items())
    fb = fbgemm_plain_is_exact()
    return (f"{info['model']} ({info['machine']}; flags: {' '.join(info['flags']) or 'none of ' + '/'.join(INT8_FLAGS)}; "
            f"torch capability {info['torch_capability']}); fbgemm plain u8*s8 "
            f"{'n/a' if fb is None else 'exact' if fb else 'saturates'}" + (f"; {ort}" if ort else ""))


# ----------------------------------------------------------------------- probes


def probe_operands(rows: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """int activations [rows, k] and int8 weights [n, k], both in ±127: full-range random values
    plus rows/columns of equal signs (every byte pair near 255 x 127: the int16 overflow)."""
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, (rows, k))
    w = rng.integers(-127, 128, (n, k))
    q[0], w[0], w[1] = 127, 127, -127
    q[-1, ::2] = -127
    return q.astype(np.int64), w.astype(np.int64)


def fbgemm_available() -> bool:
    """fbgemm's int8 linear with fp32 output exists in this torch build (x86 CPUs)."""
    return _fbgemm_available()


@functools.lru_cache(maxsize=1)
def _fbgemm_available() -> bool:
    engines = torch.backends.quantized.supported_engines  # ~15 us per query: asked once
    return hasattr(torch.ops.quantized, _FBGEMM_OP) and ("x86" in engines or "fbgemm" in engines)


def fbgemm_prepack(w_int8: torch.Tensor, scale: torch.Tensor):
    """fbgemm packed weights (no bias) from int8 values [out, in] and per-channel / per-tensor steps."""
    engine = torch.backends.quantized.engine
    if engine not in ("x86", "fbgemm"):
        torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"
    try:
        w = w_int8.detach().cpu().contiguous()
        s = scale.detach().cpu()
        with warnings.catch_warnings():  # quantized tensors are deprecated as a user API, not as fbgemm's input
            warnings.simplefilter("ignore")
            if s.numel() == 1:
                qw = torch._make_per_tensor_quantized_tensor(w, float(s.reshape(())), 0)
            else:
                qw = torch._make_per_channel_quantized_tensor(w, s.double(), torch.zeros(s.numel(), dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(qw, None)
    finally:
        torch.backends.quantized.engine = engine


def fbgemm_plain_is_exact() -> bool | None:
    """Whether fbgemm's plain call (activation zero point 128) computes exact int32 sums on this
    CPU; None where fbgemm is not available. Probed once per process."""
    return _fbgemm_probe() if fbgemm_available() else None


@functools.lru_cache(maxsize=1)
def _fbgemm_probe() -> bool:
    k, n = 256, 8
    for rows in (1, 5, 64):  # fbgemm may pick other blockings for other row counts
        q, w = probe_operands(rows, k, n)
        # steps of 1: the fp32 output is the integer sum itself (|sum| <= 256·127² < 2^24)
        packed = fbgemm_prepack(torch.from_numpy(w).to(torch.int8), torch.ones(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = getattr(torch.ops.quantized, _FBGEMM_OP)(torch.from_numpy(q).float(), 1.0, 128, packed)
        if not np.array_equal(y.numpy().astype(np.int64), q @ w.T):
            return False
    return True


def ort_gemm_is_exact(qdq_dtype: str) -> bool | None:
    """Whether onnxruntime's fused int8 GEMM for QDQ graphs stored as `qdq_dtype` (uint8 with
    zero point 128, or int8) is exact on this CPU; None without onnxruntime. Probed once."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return None
    return _ort_probe(qdq_dtype)


def ort_probes() -> dict[str, bool]:
    """{storage dtype: fused GEMM exact} for both encodings; {} without onnxruntime."""
    res = {d: ort_gemm_is_exact(d) for d in ("uint8", "int8")}
    return {d: e for d, e in res.items() if e is not None}


@functools.lru_cache(maxsize=2)
def _ort_probe(qdq_dtype: str) -> bool:
    import onnxruntime as ort

    q, w = probe_operands(8, 256, 16)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(one_linear_qdq_graph(w.T.astype(np.int8), np.ones(w.shape[0], np.float32), 1.0,
                                                     qdq_dtype), so, providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": q.astype(np.float32)})[0]
    return bool(np.array_equal(y.astype(np.int64), q @ w.T))


def one_linear_qdq_graph(w_int: np.ndarray, w_step: np.ndarray, x_step: float, dtype: str) -> bytes:
    """An ONNX model x -> Q -> DQ -> MatMul(DQ(W)) for one [K, N] int weight, stored as `dtype`
    (uint8 + 128 with zero point 128, or int8 with zero point 0), as `export/qdq.py` writes it."""
    from onnx import TensorProto, helper, numpy_helper

    np_dtype, zero = (np.uint8, 128) if dtype == "uint8" else (np.int8, 0)
    k, n = w_int.shape
    inits = [numpy_helper.from_array((w_int.astype(np.int16) + zero).astype(np_dtype), "W"),
             numpy_helper.from_array(np.asarray(w_step, np.float32), "ws"),
             numpy_helper.from_array(np.full(n, zero, np_dtype), "wz"),
             numpy_helper.from_array(np.array(x_step, np.float32), "s"),
             numpy_helper.from_array(np.array(zero, np_dtype), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["W", "ws", "wz"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["r", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["r", n])], inits)
    # IR 8 is opset 18's own: an `onnx` newer than the installed onnxruntime would otherwise stamp an
    # IR version the runtime refuses (onnx 1.23 writes 14; onnxruntime 1.30 reads up to 13)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8).SerializeToString()


# ----------------------------------------------------------------------- path choice


def requested_choice(arg: str | None, env: str, choices: tuple[str, ...], flag: str) -> str:
    """The forced choice: the argument unless None/auto, else the environment, else auto."""
    if arg is not None and arg not in choices:
        raise UsageError(f"{flag} {arg!r}: choose one of {', '.join(choices)}")
    if arg not in (None, "auto"):
        return arg
    val = os.environ.get(env, "").strip().lower() or "auto"
    if val not in choices:
        raise UsageError(f"environment variable {env}={val!r}: choose one of {', '.join(choices)} (or unset it)")
    return val


def int8_kernel(requested: str | None = None, native_ready=lambda: False) -> str:
    """`plain`, `native` or `split` for INT8 layers (see the module docstring); `native_ready()`:
    whether gptforge's own kernels are built and run a vector path here (the caller knows: this
    module sits below them; asked only when needed, since it may build them)."""
    req = requested_choice(requested, KERNEL_ENV, KERNELS, "kernel")
    if req == "auto":
        return "plain" if fbgemm_plain_is_exact() else "native" if native_ready() else "split"
    if req == "plain" and fbgemm_plain_is_exact() is False:
        _warn_inexact(f"{KERNEL_ENV}/kernel=plain: fbgemm's plain u8*s8 kernel saturates on this CPU "
                      "(int16 pair sums); INT8 outputs will not be exact")
    if req == "native" and not native_ready():
        _warn_inexact(f"{KERNEL_ENV}/kernel=native: gptforge's CPU kernels do not run a vector path here "
                      "(no compiler, GPTFORGE_NATIVE_ISA=off/scalar, or not x86); using fbgemm's split path")
        return "split"
    return req


def ort_int8_gemm(qdq_dtype: str, requested: str | None = None) -> str:
    """`on` (fused int8 GEMMs) or `off` (QDQ graph unfused) for a graph stored as `qdq_dtype`."""
    req = requested_choice(requested, ORT_GEMM_ENV, ORT_GEMMS, "--int8-gemm")
    if req == "auto":
        return "on" if ort_gemm_is_exact(qdq_dtype) else "off"
    return req


def fastest_exact_qdq_dtype() -> str:
    """Storage whose fused onnxruntime GEMM is exact here, int8 first (u8·s8 is the fast path
    of VNNI); uint8 (u8·u8, 16-bit products) otherwise."""
    return "int8" if ort_gemm_is_exact("int8") else "uint8"


@functools.cache
def _warn_inexact(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
