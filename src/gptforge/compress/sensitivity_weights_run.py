"""`run_weight_analysis`: a float model directory + calibration text -> `analyze --weights int4`'s
analysis.json (the resumable state plus, under `weights`, each layer's size and bytes at 4 and 8
bits) and analysis.txt (the ranking with sizes); what `gptforge analyze --weights` does."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gptforge.compress import sensitivity as sens
from gptforge.compress.gptq import damp_for
from gptforge.compress.sensitivity_weights import MODE, calibration_batches, weight_sensitivity
from gptforge.transforms.weight_only import WeightOnlySpec


@dataclass
class WeightAnalysis:
    analysis: sens.Analysis
    rows: list[dict]  # per layer: name, reference_name, params, bytes {4, 8}, increase {4, 8}
    files: dict[str, Path]
    calibration: str


def spec_fingerprint(spec: WeightOnlySpec, method: str, damp: float, act_order: bool) -> dict:
    """What a sensitivity file's increases depend on besides the model and the text."""
    return {"group_size": spec.group_size, "sym": spec.sym, "method": method,
            "damp": damp if method == "gptq" else None, "act_order": act_order if method == "gptq" else None,
            "head_damp": damp_for("wte", damp) if method == "gptq" else None,
            **({"clip": True} if spec.clip else {})}  # absent when off: analyses from before the flag still resume


def run_weight_analysis(ckpt: str | os.PathLike, out_dir: str | os.PathLike, spec: WeightOnlySpec, *, cfg=None,
                        calib: str | os.PathLike | None = None, samples: int = 32, seq_len: int = 256,
                        metric: str = "kl", method: str = "rtn", damp: float = 0.01, act_order: bool = False,
                        resume: bool = True, progress: bool = True) -> WeightAnalysis:
    """Analyse the float model at `ckpt` and write `out_dir`/analysis.json + analysis.txt."""
    from gptforge.compress import bit_plan
    from gptforge.compress.sensitivity_run import _batches_digest, checkpoint_digest
    from gptforge.compress.weight_only_run import load_float_model, sensitivity_inputs
    from gptforge.evaluate.common import write_json_atomic, write_text_atomic

    model, cfg, tokenizer, _ = load_float_model(ckpt, cfg)
    seq = min(seq_len, cfg.Model.max_position_embeddings) + 1  # +1: next-token pairs of seq_len positions
    windows, counts = sensitivity_inputs(tokenizer, calib, samples, seq, model.wte.num_embeddings)
    batches = calibration_batches(windows)
    calibration = f"{samples} x {seq - 1} tokens of {calib or 'the built-in corpus'}"
    fp = {"float_ckpt": checkpoint_digest(ckpt), "calibration": calibration,
          "calib_digest": _batches_digest(batches), "weights": spec_fingerprint(spec, method, damp, act_order)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = out / "analysis.json"
    with torch.no_grad():
        a = weight_sensitivity(model, spec, batches, metric=metric, method=method, damp=damp, act_order=act_order,
                               state_path=state, fingerprint=fp, resume=resume, progress=progress,
                               row_counts=counts)
    rows = bit_plan.sensitivity_rows(model, spec, a)
    full = sens.full_fingerprint(fp, MODE, a.metric, a.order)
    write_json_atomic(state, a.to_json(full) | {"weights": {"spec": spec_fingerprint(spec, method, damp, act_order),
                                                            "rows": rows}})
    txt = write_text_atomic(out / "analysis.txt", "\n".join(bit_plan.sensitivity_table(rows, a)) + "\n")
    return WeightAnalysis(a, rows, {"json": state, "txt": txt}, calibration)
