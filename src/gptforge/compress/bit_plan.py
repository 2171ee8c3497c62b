"""Mixed precision from sensitivity: give each planned layer (every block Linear and the tied
embedding / head) 4 or 8 bits so that the summed measured increase (`sensitivity_weights`) is
least within a size budget.

Every layer starts at 4 bits; moving layer i to 8 bits costs c_i more and saves
g_i = increase_4(i) - increase_8(i). Choosing the moves is a 0/1 knapsack: maximise the summed
g_i of the moved layers with their summed c_i within the budget left after every layer's
4-bit cost. `knapsack` solves it exactly by dynamic programming over cost units (the costs
divided by their greatest common divisor, which for layer sizes is large, so the table stays
small); only when that table would exceed `MAX_CELLS` are the costs rounded up to coarser
buckets (the plan still fits, and says it is not proven optimal).

Budgets: `--avg-bits B` counts the weights' own bits (4 or 8 per weight, scales and zeros
excluded) over the planned layers: sum(bits_i * params_i) <= B * sum(params_i). `--max-bytes N`
counts the bytes of every tensor of the quantized model (scales, zeros, biases, position
embeddings and norms included): what model.safetensors holds less its header. Every plan (and
`planned_bits` for any model) reports both per planned weight: the own bits and the stored bits
(the planned layers' bytes without biases, x 8), so that "4.5 bits" is never read as a size:
int4 g64 with fp32 scales is 4 own bits and 4.5 stored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch import nn

from gptforge.errors import UsageError
from gptforge.transforms.weight_only import WeightOnlyLinear, WeightOnlySpec, planned_layers, stored_bytes

MAX_CELLS = 50_000_000  # DP table cells (bools) before costs are bucketed
PLAN_JSON, PLAN_MD = "quant_plan.json", "quant_plan.md"
PLAN_FORMAT = "gptforge-quant-plan/1"


class InfeasibleBudget(UsageError):
    """The budget is below every layer at 4 bits; `minimum` is that smallest cost."""

    def __init__(self, message: str, minimum: int):
        super().__init__(message)
        self.minimum = minimum


def knapsack(costs: list[int], gains: list[float], capacity: int,
             max_cells: int = MAX_CELLS) -> tuple[list[bool], bool]:
    """(chosen, exact): the items maximising the summed gain with summed cost <= `capacity`
    (integers >= 0). Items with gain <= 0 are never chosen (they cannot help; fewer bytes win
    the tie). `exact` is False only when costs had to be bucketed to fit `max_cells`."""
    if capacity < 0:
        raise ValueError(f"capacity {capacity} < 0")
    n = len(costs)
    cand = [i for i in range(n) if gains[i] > 0 and costs[i] <= capacity]
    chosen = [False] * n
    free = [i for i in cand if costs[i] == 0]  # a positive gain for nothing
    for i in free:
        chosen[i] = True
    cand = [i for i in cand if costs[i] > 0]
    if not cand:
        return chosen, True
    unit = math.gcd(*(costs[i] for i in cand))
    exact = True
    if (capacity // unit + 1) * len(cand) > max_cells:
        unit = -(-capacity // max(1, max_cells // len(cand) - 1))  # ceil: bucketed costs round up, so still fit
        exact = False
    w = [-(-costs[i] // unit) for i in cand]
    cap = capacity // unit
    best = np.zeros(cap + 1)  # best[c]: the largest gain with summed (bucketed) cost <= c
    take = np.zeros((len(cand), cap + 1), dtype=bool)
    for k, i in enumerate(cand):
        if w[k] > cap:
            continue
        with_it = best[:cap + 1 - w[k]] + gains[i]
        better = with_it > best[w[k]:]
        take[k, w[k]:] = better
        best[w[k]:] = np.where(better, with_it, best[w[k]:])
    c = cap
    for k in range(len(cand) - 1, -1, -1):
        if take[k, c]:
            chosen[cand[k]] = True
            c -= w[k]
    return chosen, exact


# --------------------------------------------------------------------------- layer rows


def _shape(model: nn.Module, name: str, mod: nn.Module) -> tuple[int, int, bool, bool]:
    if name == "wte":
        return mod.embedding_dim, mod.num_embeddings, False, True
    return mod.in_features, mod.out_features, mod.bias is not None, False


def layer_rows(model: nn.Module, spec: WeightOnlySpec, increases: dict[str, tuple[float, float | None]]) -> list[dict]:
    """Per planned layer (model order): name, params, bytes at 4 and 8 bits, increase at 4 and 8."""
    rows = []
    for name, mod in planned_layers(model):
        if name not in increases:
            raise UsageError(f"the sensitivity analysis has no row for {name}; run `gptforge analyze --weights int4` "
                             "on this model again")
        i, o, bias, head = _shape(model, name, mod)
        inc4, inc8 = increases[name]
        rows.append({"name": name, "params": i * o, "bias_bytes": 4 * o if bias else 0,
                     "bytes": {str(b): stored_bytes(i, o, b, spec, bias=bias, head=head) for b in (4, 8)},
                     "float_bytes": stored_bytes(i, o, 32, spec, bias=bias),
                     "increase": {"4": inc4, "8": inc8}})
    return rows


def sensitivity_rows(model: nn.Module, spec: WeightOnlySpec, analysis) -> list[dict]:
    """`layer_rows` from a weight-only `sensitivity.Analysis`, with the reference's names."""
    rows = layer_rows(model, spec, {n: (r.sensitivity, r.sensitivity8) for n, r in analysis.layers.items()})
    for r in rows:
        r["reference_name"] = analysis.layers[r["name"]].reference_name
    return rows


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:+.4g}"


def sensitivity_table(rows: list[dict], analysis) -> list[str]:
    """analysis.txt of a weight-only analysis: the layers by decreasing increase at 4 bits."""
    out = [f"# gptforge analyze --weights int4: {analysis.metric_label}; base {analysis.base_value:.6g}",
           "# increase = metric with only this layer rounded (4 / 8 bits) - metric of the float model",
           f"{'rank':>4}  {'layer':<24} {'reference':<12} {'params':>10} {'bytes@4':>10} {'bytes@8':>10} "
           f"{'increase@4':>12} {'increase@8':>12}"]
    ranked = sorted(rows, key=lambda r: -r["increase"]["4"])
    for k, r in enumerate(ranked, 1):
        out.append(f"{k:>4}  {r['name']:<24} {r.get('reference_name', ''):<12} {r['params']:>10} "
                   f"{r['bytes']['4']:>10} {r['bytes']['8']:>10} {_f(r['increase']['4']):>12} "
                   f"{_f(r['increase']['8']):>12}")
    return out


def read_sensitivity(path: str | Path, float_digest: str, spec: WeightOnlySpec) -> tuple[dict, dict]:
    """({name: (increase at 4, at 8)}, the file's JSON) of `gptforge analyze --weights` output,
    UsageError when it is of another model or another grouping."""
    p = Path(path)
    p = p / "analysis.json" if p.is_dir() else p
    try:
        state = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"--sensitivity {p}: unreadable ({e.__class__.__name__}); give the analysis.json that "
                         "`gptforge analyze --weights int4` wrote") from None
    if not isinstance(state, dict) or state.get("mode") != "weights" or not state.get("complete"):
        raise UsageError(f"--sensitivity {p}: not a complete weight-only analysis; run `gptforge analyze --ckpt "
                         "MODEL --weights int4` (again) and give its analysis.json")
    fp = state.get("fingerprint") or {}
    if fp.get("float_ckpt") != float_digest:
        raise UsageError(f"--sensitivity {p}: analyses another model (its weights differ from --ckpt's); "
                         "analyse this model first")
    want = {"group_size": spec.group_size, "sym": spec.sym}
    have = {k: (fp.get("weights") or {}).get(k) for k in want}
    if have != want:
        k = next(k for k in want if have[k] != want[k])
        raise UsageError(f"--sensitivity {p}: measured with {k} {have[k]}, this run quantizes with {k} {want[k]}; "
                         "analyse with the same --group-size / --asym")
    layers = state.get("layers") or {}
    return {n: (float(r["sensitivity"]), r.get("sensitivity8")) for n, r in layers.items()}, state


# --------------------------------------------------------------------------------- plans


@dataclass
class Plan:
    rows: list[dict]  # layer_rows + "bits"
    budget: str
    total_bytes: int  # every tensor of the quantized model
    fixed_bytes: int  # the tensors no plan changes
    avg_bits: float  # the weights' own bits per planned weight
    increase: float  # the summed measured increase of the plan
    uniform4_increase: float
    exact: bool
    notes: list[str]
    source: str = ""  # where the increases came from
    stored_bits: float = 0.0  # the planned layers' bytes less biases, x 8, per planned weight (scales included)

    @property
    def layer_bits(self) -> dict[str, int]:
        return {r["name"]: r["bits"] for r in self.rows}


def fixed_bytes(model: nn.Module, rows: list[dict]) -> int:
    """Bytes of the float model's tensors that are not planned layers (they stay as they are)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return total - sum(r["float_bytes"] for r in rows)


def make_plan(rows: list[dict], fixed: int, *, avg_bits: float | None = None, max_bytes: int | None = None) -> Plan:
    """Each row 4 or 8 bits: least summed increase within `avg_bits` or `max_bytes` (one of them)."""
    if (avg_bits is None) == (max_bytes is None):
        raise UsageError("give one budget: --avg-bits B or --max-bytes N")
    notes = []
    inc8 = []
    for r in rows:
        if r["increase"]["8"] is None:
            inc8.append(0.0)
        else:
            inc8.append(r["increase"]["8"])
    if any(r["increase"]["8"] is None for r in rows):
        notes.append("increase at 8 bits not measured: taken as 0")
    gains = [r["increase"]["4"] - i8 for r, i8 in zip(rows, inc8, strict=True)]
    params = sum(r["params"] for r in rows)
    if avg_bits is not None:
        if avg_bits < 4:
            raise InfeasibleBudget(f"--avg-bits {avg_bits:g}: below 4, every layer's smallest width; give 4 <= B <= 8", 4)
        extra = [4 * r["params"] for r in rows]
        capacity = math.floor(avg_bits * params + 1e-9) - 4 * params
        budget = f"--avg-bits {avg_bits:g}"
    else:
        least = fixed + sum(r["bytes"]["4"] for r in rows)
        if max_bytes < least:
            raise InfeasibleBudget(f"--max-bytes {max_bytes}: below the smallest model this plan can make, {least} "
                                   f"bytes (every layer at 4 bits); give --max-bytes {least} or more", least)
        extra = [r["bytes"]["8"] - r["bytes"]["4"] for r in rows]
        capacity = max_bytes - least
        budget = f"--max-bytes {max_bytes}"
    chosen, exact = knapsack(extra, gains, capacity)
    if not exact:
        notes.append("costs bucketed to keep the DP table small: the plan fits but is not proven optimal")
    out = [dict(r, bits=8 if c else 4) for r, c in zip(rows, chosen, strict=True)]
    layer = [r["bytes"][str(r["bits"])] for r in out]
    inc = sum(r["increase"]["4"] if r["bits"] == 4 else i8 for r, i8 in zip(out, inc8, strict=True))
    stored = 8 * sum(b - r.get("bias_bytes", 0) for r, b in zip(out, layer, strict=True)) / params
    return Plan(out, budget, fixed + sum(layer), fixed, sum(r["bits"] * r["params"] for r in out) / params, inc,
                sum(r["increase"]["4"] for r in rows), exact, notes, stored_bits=stored)


def planned_bits(model: nn.Module) -> tuple[float, float]:
    """(own, stored) bits per planned weight (every block Linear and the tied embedding / head) of
    a float or weight-only model: own = each weight's width (4, 8, 16, 32; what `--avg-bits`
    budgets), stored = the layers' bytes without biases (weights, group scales, zeros, AWQ input
    scales) x 8 / weights: what each planned weight costs in the file `--max-bytes` counts."""
    own = stored = params = 0
    for _, mod in planned_layers(model):
        if isinstance(mod, WeightOnlyLinear):
            n, bits = mod.in_features * mod.out_features, mod.bits
        else:
            n, bits = mod.weight.numel(), 8 * mod.weight.element_size()
        own += bits * n
        stored += 8 * sum(t.numel() * t.element_size() for k, t in mod.state_dict().items() if k != "bias")
        params += n
    return own / params, stored / params


def plan_json(plan: Plan, extra: dict | None = None) -> dict:
    return {"format": PLAN_FORMAT, "budget": plan.budget, "total_bytes": plan.total_bytes,
            "fixed_bytes": plan.fixed_bytes, "avg_bits": plan.avg_bits, "stored_bits": plan.stored_bits,
            "predicted_increase": plan.increase,
            "uniform4_increase": plan.uniform4_increase, "exact": plan.exact, "notes": plan.notes,
            "layer_bits": plan.layer_bits, "layers": plan.rows, **(extra or {})}


def plan_markdown(plan: Plan, metric: str = "") -> str:
    """quant_plan.md: the budget, the totals and one row per layer."""
    n8 = sum(r["bits"] == 8 for r in plan.rows)
    lines = [f"# Mixed-precision plan ({plan.budget})", "",
             f"{n8} of {len(plan.rows)} layers at 8 bits, the rest at 4; {plan.avg_bits:.3f} bits per planned "
             f"weight ({plan.stored_bits:.3f} as stored, with the group scales and zeros); {plan.total_bytes} bytes "
             f"of tensors ({plan.fixed_bytes} outside the planned layers).",
             f"Summed measured increase{' (' + metric + ')' if metric else ''}: {plan.increase:.6g} "
             f"(every layer at 4 bits: {plan.uniform4_increase:.6g}).",
             *(f"Note: {n}." for n in plan.notes), "",
             "| layer | params | bits | bytes | increase@4 | increase@8 |", "|---|---:|---:|---:|---:|---:|"]
    for r in plan.rows:
        lines.append(f"| {r['name']} | {r['params']} | {r['bits']} | {r['bytes'][str(r['bits'])]} | "
                     f"{_f(r['increase']['4'])} | {_f(r['increase']['8'])} |")
    return "\n".join(lines) + "\n"


def write_plan(plan: Plan, d: str | Path, metric: str = "", extra: dict | None = None) -> list[Path]:
    d = Path(d)
    (d / PLAN_JSON).write_text(json.dumps(plan_json(plan, extra), indent=1) + "\n", encoding="utf-8")
    (d / PLAN_MD).write_text(plan_markdown(plan, metric), encoding="utf-8")
    return [d / PLAN_JSON, d / PLAN_MD]
