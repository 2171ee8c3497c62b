"""torch.export: the decoding step as a `.pt2` program with dynamic batch, sequence and past.

`export_torch(model, out_dir, tokenizer, cfg=cfg)` writes `model.pt2` (`torch.export.save`
of the step function in `step.py`: the same inputs and outputs as the ONNX export),
config.yaml, the tokenizer and gptforge_export.json. Unless `check=False` it reloads the file
and compares it with the PyTorch model (prefill + KV-cache steps, see `program.py`).

An INT8 program (from a quantized checkpoint) holds the `gptforge::quantize_dequantize` /
`gptforge::dequantize_weight` ops: load it with `load_program(dir)` (or `import
gptforge.export.qdq` before `torch.export.load`).

    from gptforge.export import load_program
    ep, meta = load_program("out/pt2")
    logits, *present = ep.module()(input_ids, position_ids, attention_mask, logits_index, *past)
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from gptforge.export.program import ExportReport

MODEL_FILE = "model.pt2"


def export_torch(model: nn.Module, out_dir: str | os.PathLike, tokenizer=None, *, cfg=None, precision: str = "auto",
                 check: bool = True, overwrite: bool = False) -> ExportReport:
    """Write `model` as a torch.export program directory (see the module docstring)."""
    from gptforge.export.common import check_plain_linears, model_kind, quiet_exporter, resolve_precision
    from gptforge.export.program import check_program, graph_model, new_report, write_side_files
    from gptforge.export.step import StepModel, dynamic_shapes, example_inputs
    from gptforge.model_io import atomic_dir

    t0 = time.perf_counter()
    check_plain_linears(model, "torch.export")
    kind = model_kind(model)
    prec = resolve_precision(precision, kind)
    gm = graph_model(model, prec)
    report = new_report("torch", model, gm, prec, kind, out_dir, tokenizer, "uint8")
    with quiet_exporter():
        ep = torch.export.export(StepModel(gm).eval(), example_inputs(gm),
                                 dynamic_shapes=dynamic_shapes(report.num_layers, report.max_positions))
    with atomic_dir(out_dir, overwrite) as tmp:
        torch.export.save(ep, str(tmp / MODEL_FILE))
        del ep
        if check:
            loaded = torch.export.load(str(tmp / MODEL_FILE)).module()
            int8 = prec == "int8"
            report.check = check_program(lambda xs: list(loaded(*xs)), model if int8 else gm, report,
                                         gm if int8 else None)
        report.seconds = round(time.perf_counter() - t0, 2)
        write_side_files(tmp, report, cfg, tokenizer)
    return report


def load_program(path: str | os.PathLike):
    """(ExportedProgram, gptforge_export.json contents) of a `gptforge export --format torch` directory."""
    import gptforge.export.qdq  # noqa: F401 - registers the INT8 ops the program may call
    from gptforge.export.common import read_export_dir

    p, meta = read_export_dir(path, "torch")
    return torch.export.load(str(p / MODEL_FILE)), meta
