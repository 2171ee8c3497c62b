"""onnxruntime sessions over our ONNX exports: the INT8 GEMM choice and a tensor runner, shared by
the export's check against PyTorch (`onnx.py`) and the inference backend (`generate/ort_backend.py`).

INT8 GEMMs (`int8_gemm`). onnxruntime fuses each QDQ MatMul into an int8 GEMM
(`MatMulIntegerToFloat`): its u8·u8 kernel for graphs stored as uint8 (the default, `qdq.py`),
its s8 kernel for graphs stored as int8. On x86 CPUs without VNNI the s8 kernel adds pairs of
u8·s8 products into saturating int16 (`vpmaddubsw`) and is far off for full-range weights.
`auto` fuses where a one-time probe finds the kernel for the graph's storage exact on the
running CPU (`transforms/cpu_kernels.py`); elsewhere (`off`) the QDQ graph runs as written
(`session.disable_quant_qdq`: activations are still rounded to their int8 steps, the products
run in fp32, exact but no faster than fp32). `on` / `off` (or `GPTFORGE_ORT_INT8_GEMM`) force it.
"""

from __future__ import annotations

import os

import torch

from gptforge.errors import CheckpointError, UsageError
from gptforge.transforms.cpu_kernels import ORT_GEMMS, ort_gemm_is_exact, ort_int8_gemm

INT8_GEMM = ORT_GEMMS


def s8_gemm_is_exact() -> bool:
    """Whether onnxruntime's s8 GEMM (int8-stored graphs) is exact on this CPU (probed once)."""
    return bool(ort_gemm_is_exact("int8"))


def int8_gemm_mode(meta: dict, requested: str | None = "auto") -> str:
    """`on`, `off` or `n/a` (an fp32 graph) for an export described by `meta`; `requested`
    None/auto = `GPTFORGE_ORT_INT8_GEMM`, else the probe's choice (module docstring)."""
    if requested is not None and requested not in INT8_GEMM:
        raise UsageError(f"--int8-gemm {requested!r}: choose one of {', '.join(INT8_GEMM)}")
    if meta.get("precision") != "int8":
        return "n/a"
    return ort_int8_gemm(meta.get("qdq_dtype", "int8"), requested)


def make_session(path: str | os.PathLike, meta: dict, *, int8_gemm: str = "auto", threads: int | None = None):
    """(onnxruntime InferenceSession on CPU, the int8 GEMM mode used)."""
    import onnxruntime as ort

    mode = int8_gemm_mode(meta, int8_gemm)
    so = ort.SessionOptions()
    so.log_severity_level = 3  # errors only: no optimizer chatter on stderr
    if threads:
        so.intra_op_num_threads = int(threads)
    if mode == "off":
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    try:
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise CheckpointError(f"{path}: onnxruntime cannot load it ({str(e).splitlines()[0][:200]})") from None
    return sess, mode


def session_runner(sess, names: list[str]):
    """`run(list of torch tensors) -> list of torch tensors` over an onnxruntime session."""
    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        feeds = {n: t.numpy() for n, t in zip(names, inputs, strict=True)}
        return [torch.from_numpy(o) for o in sess.run(None, feeds)]

    return run
