"""Weight-only sensitivity (`gptforge analyze --weights int4`): for each block Linear and the tied
embedding / LM head, the increase of a metric when only that layer's weights are rounded to 4
bits (and to 8 bits), everything else float. `quantize --avg-bits / --max-bytes` plans each
layer's bit-width from these increases (`bit_plan`).

The default metric is KL(float ‖ model) of the next-token distributions on calibration windows,
not the change in held-out loss: KL is never negative, it is 0 exactly when the layer's rounding
changes nothing, and for small perturbations it is second order in the weight error and close to
additive over layers, which is what a knapsack that sums per-layer increases assumes. A loss
difference is a noisy, signed estimate (rounding a little-trained layer can lower the loss by
chance, see benchmarks/results/2026-11-25-lowbit-quality.md). `--metric loss` is still offered.

The layer's rounded weight is copied into the float layer for the measurement and the original
put back (`sensitivity._weight_replaced`), so the model ends as it began; the loop, progress bar
and resumable state file are `sensitivity.run_layers`'. `method="gptq"` rounds each layer with
GPTQ from its inputs in the float model (the other layers float, as the measurement assumes).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from gptforge.compress import head_rows
from gptforge.compress import sensitivity as sens
from gptforge.compress.gptq import damp_for, gptq_quantize
from gptforge.errors import UsageError
from gptforge.progress import bar
from gptforge.transforms import lowbit
from gptforge.transforms.weight_only import WeightOnlySpec, check_shapes, planned_layers

MODE = "weights"
METRICS = ("kl", "loss")
METHODS = ("rtn", "gptq")
HEAD = "wte"
WINDOWS_PER_BATCH = 8


def reference(name: str) -> str:
    """The reference's name of a planned layer (`linear_N`; the tied embedding `embedding_0`)."""
    return "embedding_0" if name == HEAD else sens.reference_name(name)


def calibration_batches(windows: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Windows [1, seq] of token ids -> batches of next-token pairs (tokens, labels), 8 windows each."""
    ids = torch.cat(windows)
    return [{"tokens": ids[i:i + WINDOWS_PER_BATCH, :-1], "labels": ids[i:i + WINDOWS_PER_BATCH, 1:]}
            for i in range(0, len(ids), WINDOWS_PER_BATCH)]


def hessians(model: nn.Module, names: list[str], batches: list[dict]) -> dict[str, torch.Tensor]:
    """GPTQ's H of every named layer from its inputs in the float model (the head's: the final norm's output)."""
    from gptforge.compress.gptq import _Hessian
    from gptforge.compress.layerwise import _collect

    head = _Hessian(model.wte.embedding_dim) if HEAD in names else None
    hook = model.norm.register_forward_hook(lambda mod, a, out: head(None, (out,))) if head else None
    try:
        with torch.no_grad():
            hs = _collect(model, [n for n in names if n != HEAD], _Hessian,
                          lambda: [model.hidden_states(b["tokens"]) for b in batches])
    finally:
        if hook is not None:
            hook.remove()
    if head is not None:
        hs[HEAD] = head.value()
    return hs


def rounded_weight(w: torch.Tensor, bits: int, spec: WeightOnlySpec, H: torch.Tensor | None = None,
                   damp: float = 0.01, act_order: bool = False) -> torch.Tensor:
    """`w` as the weight-only layer computes with it: rounded to nearest, or by GPTQ given H."""
    if H is None:
        q, s, z = lowbit.quantize_rtn(w, bits, spec.group_size, spec.sym, spec.clip)
    else:
        q, s, z = gptq_quantize(w.float(), H, bits, spec.group_size, spec.sym, damp=damp, act_order=act_order,
                                clip=spec.clip)
    return lowbit.dequantize(q, s, z, spec.group_size).to(w.dtype)


def build_metric(model: nn.Module, batches: list[dict], metric: str) -> sens.Metric:
    if metric not in METRICS:
        raise UsageError(f"--metric {metric}: weight-only analysis measures kl (default) or loss")
    if metric == "loss":
        return sens.loss_metric(batches, f"{len(batches)} calibration batches")
    return sens.distance_metric(batches, sens.reference_outputs(model, batches), "kl")


def weight_sensitivity(model: nn.Module, spec: WeightOnlySpec, batches: list[dict], *, metric: str = "kl",
                       method: str = "rtn", damp: float = 0.01, act_order: bool = False, eight_bits: bool = True,
                       state_path: str | Path | None = None, fingerprint: dict | None = None, resume: bool = True,
                       progress: bool = False, row_counts: torch.Tensor | None = None) -> sens.Analysis:
    """Each planned layer's increase in `metric` with only it rounded to 4 bits (and 8 with
    `eight_bits`) on `batches` of the float `model` (see the module docstring); the head's rows
    ranked by `row_counts` first (`head_rows.token_counts` of the calibration text)."""
    if method not in METHODS:
        raise UsageError(f"--method {method}: the weight-only analysis rounds with rtn or gptq")
    check_shapes(model, spec)
    model.eval()
    names = [n for n, _ in planned_layers(model)]
    m = build_metric(model, batches, metric)
    hs = hessians(model, names, batches) if method == "gptq" else {}

    def weight_of(name: str) -> nn.Parameter:
        return model.wte.weight if name == HEAD else model.get_submodule(name).weight

    def evaluate(name: str) -> tuple[float, float | None]:
        w = weight_of(name).detach().float()
        values = []
        for bits in (4, 8) if eight_bits else (4,):
            wq = rounded_weight(w, bits, spec, hs.get(name), damp_for(name, damp), act_order)
            with sens._weight_replaced(_WeightHolder(weight_of(name)), wq):
                values.append(m(model))
        return values[0], (values[1] if eight_bits else None)

    a = sens.run_layers(model, m, MODE, names, lambda: m(model), evaluate, state_path=state_path,
                        fingerprint=fingerprint, resume=resume, progress=progress, reference=reference)
    if HEAD in names and spec.bits_for(HEAD) in (4, 8):
        a.head_rows = _earlier_head_rows(state_path, resume, len(model.wte.weight), row_counts)
        if a.head_rows is None:
            a.head_rows = head_row_ladder(model, spec, batches, m, a.base_value, hs.get(HEAD), damp, act_order,
                                          progress, row_counts)
            if state_path is not None:
                sens._write_state(Path(state_path), a, sens.full_fingerprint(fingerprint, MODE, m.name, names))
    return a


def head_row_ladder(model: nn.Module, spec: WeightOnlySpec, batches: list[dict], m: sens.Metric, base: float,
                    H: torch.Tensor | None = None, damp: float = 0.01, act_order: bool = False,
                    progress: bool = False, counts: torch.Tensor | None = None) -> dict:
    """The head's rows ranked (`head_rows.row_order`: by `counts`, then the estimated gain from 8
    bits) and the measured increase with the top k at 8 bits for k on `head_rows.FRACTIONS` of the
    vocabulary (`head_rows`)."""
    w = model.wte.weight.detach().float()
    w4, w8 = (rounded_weight(w, b, spec, H, damp_for(HEAD, damp), act_order) for b in (4, 8))
    order = head_rows.row_order(model, batches, w, w4, w8, counts)
    sizes = head_rows.ladder_sizes(len(w))
    pbar = bar(total=len(sizes), desc="analyze (head rows)", unit="step", enabled=progress)

    def measured(wq: torch.Tensor) -> float:
        with sens._weight_replaced(_WeightHolder(model.wte.weight), wq):
            return m(model) - base

    try:
        ladder = head_rows.measure_ladder(measured, w4, w8, order, sizes, progress=lambda k: pbar.update(1))
    finally:
        pbar.close()
    return head_rows.head_rows_result(order, ladder, counts)


def _earlier_head_rows(state_path, resume: bool, vocab: int, counts: torch.Tensor | None) -> dict | None:
    """A complete earlier run's head-row ladder (`run_layers` has checked that the state file is of
    these inputs) when it was ranked the way this run ranks (the same token counts, or none)."""
    if state_path is None or not resume or not Path(state_path).is_file():
        return None
    hr = json.loads(Path(state_path).read_text(encoding="utf-8")).get("head_rows")
    try:
        head_rows.parse_head_rows(hr, vocab)
    except ValueError:  # none yet, or damaged: measured again
        return None
    if hr.get("counts") != (None if counts is None else head_rows.counts_digest(counts)):
        return None  # ranked otherwise (e.g. before the counts): ranked and measured again
    return hr


class _WeightHolder:
    """`_weight_replaced` takes a module with `.weight`; the tied embedding's parameter is shared."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
