"""ONNX export: fp32, or INT8 QDQ from a quantized checkpoint, with past keys/values for decoding.

`export_onnx(model, out_dir, tokenizer, cfg=cfg)` writes

    model.onnx            one graph for prefill and decode steps (inputs and outputs: `step.py`;
                          weights go to model.onnx.data when the model passes 2 GB)
    config.yaml           the model's resolved config (Generation defaults for `gptforge infer`)
    gptforge_export.json  what was exported: precision, shapes, input/output names, the check
    tokenizer files

through `torch.onnx.export(dynamo=True)` at opset 18 with dynamic batch, sequence and past
length, validates it with `onnx.checker` (full check, with shape inference), and unless
`check=False` runs it in onnxruntime, with the session settings `gptforge infer` uses, against
PyTorch (see `program.py`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

from gptforge.export.program import ExportReport

OPSET = 18
MODEL_FILE = "model.onnx"


def export_onnx(model: nn.Module, out_dir: str | os.PathLike, tokenizer=None, *, cfg=None, precision: str = "auto",
                qdq_dtype: str = "uint8", check: bool = True, overwrite: bool = False) -> ExportReport:
    """Write `model` (float, pruned, fake-quant or INT8) as an ONNX directory (see the module
    docstring). `precision`: auto (int8 for quantized models) | fp32 | int8. `qdq_dtype`: how
    INT8 integers are stored (uint8 | int8 | auto, `qdq.py`). `cfg`: the model's whole Config, saved as config.yaml."""
    import onnx

    from gptforge.export.common import check_plain_linears, model_kind, quiet_exporter, resolve_precision
    from gptforge.export.program import graph_model, new_report, write_side_files
    from gptforge.export.qdq import onnx_translations, resolve_qdq_dtype
    from gptforge.export.step import StepModel, dynamic_shapes, example_inputs
    from gptforge.model_io import atomic_dir

    t0 = time.perf_counter()
    check_plain_linears(model, "the ONNX export")
    kind = model_kind(model)
    prec = resolve_precision(precision, kind)
    qdq_dtype = resolve_qdq_dtype(qdq_dtype)  # `auto`: the report records what was written
    gm = graph_model(model, prec, qdq_dtype)
    report = new_report("onnx", model, gm, prec, kind, out_dir, tokenizer, qdq_dtype)
    report.opset = OPSET
    with quiet_exporter():
        prog = torch.onnx.export(
            StepModel(gm).eval(), example_inputs(gm), dynamo=True, opset_version=OPSET, verbose=False,
            input_names=report.inputs, output_names=report.outputs,
            dynamic_shapes=dynamic_shapes(report.num_layers, report.max_positions),
            custom_translation_table=onnx_translations() if prec == "int8" else None)
    with atomic_dir(out_dir, overwrite) as tmp:
        with quiet_exporter():
            prog.save(tmp / MODEL_FILE)
        del prog
        try:
            onnx.checker.check_model(str(tmp / MODEL_FILE), full_check=True)
        except onnx.checker.ValidationError as e:  # a bug, not user input: keep the message whole
            raise RuntimeError(f"onnx.checker rejected the exported graph: {e}") from e
        if check:
            report.check = check_onnx(tmp / MODEL_FILE, model, gm, report)
        report.seconds = round(time.perf_counter() - t0, 2)
        write_side_files(tmp, report, cfg, tokenizer)
    return report


def check_onnx(path: Path, model: nn.Module, gm: nn.Module, report: ExportReport) -> dict:
    """Logits of the ONNX model in onnxruntime vs PyTorch (see `program.py`): the quantized
    `model` for int8, else the traced float module `gm`."""
    from dataclasses import asdict

    from gptforge.export.ort_session import make_session, session_runner
    from gptforge.export.program import check_program

    sess, gemm = make_session(path, asdict(report))
    int8 = report.precision == "int8"
    res = check_program(session_runner(sess, report.inputs), model if int8 else gm, report, gm if int8 else None)
    res["int8_gemm"] = gemm
    return res
