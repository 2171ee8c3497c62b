"""What the two step-program exports (ONNX, torch.export) share: the module they trace, the
description written next to the program, and the numerical check against PyTorch.

The check runs the exported program as `gptforge infer` does (a prefill, then one token per
step through the returned cache) and the PyTorch model through its own `KVCache`, on a small
random batch:
- fp32: the largest logit difference must stay within 1e-4 x max(1, max|logit|);
- int8: the greedy-argmax agreement with the quantized PyTorch model (fake-quant or INT8)
  must reach 99%. Bit equality is not expected: fp32 sums in another order can move a later
  activation by one quantization step, and in a deep model with random or barely trained
  weights such a step can grow to the size of the quantization noise (measured: a random
  345M-shape QAT model agrees with itself evaluated in fp64 on 94% of tokens). So below
  99% both are compared with exact arithmetic, the traced QDQ module evaluated in fp64, and
  the export passes when it is no further from it than the PyTorch model is (within 3 points:
  the statistic of a few hundred tokens is noisy).
A failed check raises `CheckpointError` and nothing is written.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from gptforge.errors import CheckpointError
from gptforge.export.common import META_FILE

FP32_TOLERANCE = 1e-4  # x max(1, max|logit|)
INT8_MIN_AGREEMENT = 0.99
INT8_FLOOR_MARGIN = 0.03
CHECK_ROWS, CHECK_TOKENS, CHECK_DECODE = 8, 32, 8


@dataclass
class ExportReport:
    """The contents of gptforge_export.json (what `gptforge infer` and `load_program` read)."""

    format: str  # onnx | torch
    precision: str  # fp32 | int8
    source_kind: str  # float | fake-quant | int8
    out_dir: str
    files: list[str] = field(default_factory=list)
    num_layers: int = 0
    layer_heads: list[int] = field(default_factory=list)
    head_dim: int = 0
    vocab_size: int = 0
    max_positions: int = 0
    eos_token_id: int | None = None
    qdq_dtype: str | None = None  # int8 exports: uint8 | int8 (how the integers are stored)
    opset: int | None = None
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    check: dict = field(default_factory=dict)
    seconds: float = 0.0
    gptforge_version: str = ""


def graph_model(model: nn.Module, precision: str, qdq_dtype: str = "uint8") -> nn.Module:
    """The module the exported graph computes: QDQ modules for int8, folded floats for fp32."""
    from gptforge.export.common import fold_quantization
    from gptforge.export.qdq import to_qdq

    return to_qdq(model, qdq_dtype) if precision == "int8" else fold_quantization(model)


def new_report(fmt: str, model: nn.Module, gm: nn.Module, precision: str, kind: str, out_dir, tokenizer,
               qdq_dtype: str | None = None) -> ExportReport:
    import gptforge
    from gptforge.export.step import input_names, layer_heads, output_names

    L = len(gm.blocks)
    return ExportReport(format=fmt, precision=precision, source_kind=kind, out_dir=str(out_dir), num_layers=L,
                        layer_heads=layer_heads(gm), head_dim=int(gm.blocks[0].attn.head_dim),
                        vocab_size=int(gm.wte.weight.shape[0]),
                        max_positions=int(model.config.max_position_embeddings),
                        eos_token_id=tokenizer.eos_token_id if tokenizer is not None else None,
                        qdq_dtype=qdq_dtype if precision == "int8" else None,
                        inputs=input_names(L), outputs=output_names(L), gptforge_version=gptforge.__version__)


def check_ids(report: ExportReport, seed: int = 0) -> tuple[torch.Tensor, int]:
    """(ids [rows, T], prompt length) for the export check."""
    T = min(CHECK_TOKENS, report.max_positions)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, report.vocab_size, (CHECK_ROWS, T), generator=g), max(1, T - CHECK_DECODE)


@torch.no_grad()
def compare(reference: torch.Tensor, got: torch.Tensor) -> dict:
    """Largest logit difference and greedy-argmax agreement of `got` against `reference`."""
    ref, got = reference.float(), got.float()
    return {"max_abs_diff": float((ref - got).abs().max()), "max_abs_logit": float(ref.abs().max()),
            "argmax_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
            "positions": int(ref.shape[0] * ref.shape[1])}


def verdict(res: dict, precision: str) -> None:
    """Raise CheckpointError when a check result (see the module docstring) fails."""
    if precision == "fp32":
        limit = FP32_TOLERANCE * max(1.0, res["max_abs_logit"])
        if res["max_abs_diff"] > limit:
            raise CheckpointError(f"the exported model's logits differ from PyTorch by {res['max_abs_diff']:.3g} "
                                  f"(limit {limit:.3g}); nothing was written (--no-check skips this check)")
        return
    agree = res["argmax_agreement"]
    exact = res.get("fp64_agreement")  # {"export": .., "pytorch": ..} against exact arithmetic
    if agree < INT8_MIN_AGREEMENT and (exact is None or exact["export"] < exact["pytorch"] - INT8_FLOOR_MARGIN):
        vs = (f"; against fp64 arithmetic the export agrees on {exact['export']:.1%}, PyTorch on "
              f"{exact['pytorch']:.1%}" if exact is not None else "")
        raise CheckpointError(f"the exported INT8 model agrees with the PyTorch quantized model on {agree:.1%} of "
                              f"greedy tokens (< {INT8_MIN_AGREEMENT:.0%}){vs}; nothing was written "
                              "(--no-check skips this check)")


@torch.no_grad()
def check_program(run, reference: nn.Module, report: ExportReport, twin: nn.Module | None = None) -> dict:
    """Check a step function `run` (list of tensors -> list of tensors) against `reference`;
    `twin` (the traced module, int8 only) is run in fp64 when the agreement needs a yardstick."""
    from gptforge.export.step import cached_logits, teacher_forced_logits

    ids, prompt = check_ids(report)
    want = cached_logits(reference, ids, prompt)
    got = teacher_forced_logits(run, report.layer_heads, report.head_dim, ids, prompt)
    res = compare(want, got)
    if report.precision == "int8" and res["argmax_agreement"] < INT8_MIN_AGREEMENT and twin is not None:
        exact = cached_logits(copy.deepcopy(twin).double(), ids, prompt)
        res["fp64_agreement"] = {"export": compare(exact, got)["argmax_agreement"],
                                 "pytorch": compare(exact, want)["argmax_agreement"]}
    res.update(prefill_tokens=prompt, decode_steps=int(ids.shape[1] - prompt))
    verdict(res, report.precision)
    return res


def write_side_files(tmp: Path, report: ExportReport, cfg, tokenizer) -> None:
    """config.yaml, tokenizer files and the export description, next to the program."""
    from gptforge.config import config_to_yaml

    if cfg is not None:
        (tmp / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save(tmp)
    report.files = sorted([*(p.name for p in tmp.iterdir()), META_FILE])
    (tmp / META_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n", encoding="utf-8")
