"""Mixed precision from sensitivity: give each planned layer (every block Linear and the tied
embedding / head) 4 or 8 bits so that the summed measured increase (`sensitivity_weights`) is
least within a size budget.

Every layer starts at 4 bits; moving layer i to 8 bits costs c_i more and saves
g_i = increase_4(i) - increase_8(i). Choosing the moves is a 0/1 knapsack: maximise the summed
g_i of the moved layers with their summed c_i within the budget left after every layer's
4-bit cost. `knapsack` solves it exactly by dynamic programming over cost units (the costs
divided by their greatest common divisor, which for layer sizes is large, so the table stays
small); only when that table would exceed `MAX_CELLS` are the costs rounded up to coarser
buckets (the plan still fits, and says it is not proven optimal). The head has more choices
than 8 bits whole: its top k rows at 8 (`head_rows`' measured ladder); a layer's choices form a
group of which the knapsack buys at most one.

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
from dataclasses import dataclass, field
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


def knapsack(costs: list[int], gains: list[float], capacity: int, max_cells: int = MAX_CELLS,
             groups: list[int] | None = None) -> tuple[list[bool], bool]:
    """(chosen, exact): the items maximising the summed gain with summed cost <= `capacity`
    (integers >= 0), at most one item of each group (`groups[i]`: item i's group; default: every
    item its own, the plain 0/1 knapsack). Items with gain <= 0 are never chosen (they cannot
    help; fewer bytes win the tie). `exact` is False only when costs had to be bucketed to fit
    `max_cells`."""
    if capacity < 0:
        raise ValueError(f"capacity {capacity} < 0")
    n = len(costs)
    groups = list(range(n)) if groups is None else groups
    cand = [i for i in range(n) if gains[i] > 0 and costs[i] <= capacity]
    chosen = [False] * n
    if not cand:
        return chosen, True
    unit = math.gcd(*(costs[i] for i in cand)) or 1
    by_group: dict[int, list[int]] = {}
    for i in cand:
        by_group.setdefault(groups[i], []).append(i)
    exact = True
    if (capacity // unit + 1) * len(by_group) > max_cells:
        unit = -(-capacity // max(1, max_cells // len(by_group) - 1))  # ceil: bucketed costs round up, so still fit
        exact = False
    cap = capacity // unit
    best = np.zeros(cap + 1)  # best[c]: the largest gain with summed (bucketed) cost <= c
    members = list(by_group.values())
    if max(map(len, members)) > 127:
        raise ValueError("a group of more than 127 items")
    take = np.full((len(members), cap + 1), -1, dtype=np.int8)  # the group's option taken at each cost
    for k, items in enumerate(members):
        prev = best.copy()  # every option of this group is weighed against the groups before it only
        for j, i in enumerate(items):
            w = -(-costs[i] // unit)
            if w > cap:
                continue
            with_it = prev[:cap + 1 - w] + gains[i]
            better = with_it > best[w:]
            take[k, w:][better] = j
            best[w:] = np.where(better, with_it, best[w:])
    c = cap
    for k in range(len(members) - 1, -1, -1):
        j = int(take[k, c])
        if j >= 0:
            i = members[k][j]
            chosen[i] = True
            c -= -(-costs[i] // unit)
    return chosen, exact


# --------------------------------------------------------------------------- layer rows


def _shape(model: nn.Module, name: str, mod: nn.Module) -> tuple[int, int, bool, bool]:
    if name == "wte":
        return mod.embedding_dim, mod.num_embeddings, False, True
    return mod.in_features, mod.out_features, mod.bias is not None, False


def layer_rows(model: nn.Module, spec: WeightOnlySpec, increases: dict[str, tuple[float, float | None]],
               head: dict | None = None) -> list[dict]:
    """Per planned layer (model order): name, params, bytes at 4 and 8 bits, increase at 4 and 8;
    with `head` (`head_rows.read_head_rows` of an analysis) the head's row also lists `options`:
    its top k rows at 8 bits and the rest at 4 (rows8, the 8-bit rows' params, bytes, increase)."""
    rows = []
    for name, mod in planned_layers(model):
        if name not in increases:
            raise UsageError(f"the sensitivity analysis has no row for {name}; run `gptforge analyze --weights int4` "
                             "on this model again")
        i, o, bias, head_ = _shape(model, name, mod)
        inc4, inc8 = increases[name]
        rows.append({"name": name, "params": i * o, "bias_bytes": 4 * o if bias else 0,
                     "bytes": {str(b): stored_bytes(i, o, b, spec, bias=bias, head=head_) for b in (4, 8)},
                     "float_bytes": stored_bytes(i, o, 32, spec, bias=bias),
                     "increase": {"4": inc4, "8": inc8}})
        if head_ and head is not None:
            rows[-1]["options"] = [{"rows8": r["rows8"], "params8": r["rows8"] * i, "increase": r["increase"],
                                    "bytes": stored_bytes(i, r["rows8"], 8, spec, head=True)
                                    + stored_bytes(i, o - r["rows8"], 4, spec, head=True)}
                                   for r in head["ladder"]]
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
    ladder = (getattr(analysis, "head_rows", None) or {}).get("ladder") or []
    if ladder:
        out.append("# wte with its k most used rows at 8 bits, the rest at 4 (rows8: increase): "
                   + ", ".join(f"{r['rows8']}: {_f(r['increase'])}" for r in ladder))
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
    head_rows8: list[int] = field(default_factory=list)  # the head's rows at 8 bits (ascending) when split

    @property
    def layer_bits(self) -> dict[str, int]:
        return {r["name"]: r["bits"] for r in self.rows}


def fixed_bytes(model: nn.Module, rows: list[dict]) -> int:
    """Bytes of the float model's tensors that are not planned layers (they stay as they are)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return total - sum(r["float_bytes"] for r in rows)


def make_plan(rows: list[dict], fixed: int, *, avg_bits: float | None = None, max_bytes: int | None = None,
              head_order: list[int] | None = None) -> Plan:
    """Each row 4 or 8 bits, or, for a row with `options` (the head), its top k rows of
    `head_order` at 8 bits: least summed increase within `avg_bits` or `max_bytes` (one of them)."""
    if (avg_bits is None) == (max_bytes is None):
        raise UsageError("give one budget: --avg-bits B or --max-bytes N")
    notes = []
    inc8 = [0.0 if r["increase"]["8"] is None else r["increase"]["8"] for r in rows]
    if any(r["increase"]["8"] is None for r in rows):
        notes.append("increase at 8 bits not measured: taken as 0")
    params = sum(r["params"] for r in rows)
    if avg_bits is not None:
        if avg_bits < 4:
            raise InfeasibleBudget(f"--avg-bits {avg_bits:g}: below 4, every layer's smallest width; give 4 <= B <= 8", 4)
        capacity = math.floor(avg_bits * params + 1e-9) - 4 * params
        budget = f"--avg-bits {avg_bits:g}"
    else:
        least = fixed + sum(r["bytes"]["4"] for r in rows)
        if max_bytes < least:
            raise InfeasibleBudget(f"--max-bytes {max_bytes}: below the smallest model this plan can make, {least} "
                                   f"bytes (every layer at 4 bits); give --max-bytes {least} or more", least)
        capacity = max_bytes - least
        budget = f"--max-bytes {max_bytes}"
    # the choices: a row whole at 8 bits (option None) or one of its head options; one per row at most
    items = [(k, None) for k in range(len(rows))]
    items += [(k, j) for k, r in enumerate(rows) for j in range(len(r.get("options", ())))]
    chosen, exact = knapsack([_extra(rows[k], j, avg_bits is not None) for k, j in items],
                             [rows[k]["increase"]["4"] - (inc8[k] if j is None else rows[k]["options"][j]["increase"])
                              for k, j in items], capacity, groups=[k for k, _ in items])
    if not exact:
        notes.append("costs bucketed to keep the DP table small: the plan fits but is not proven optimal")
    pick = {k: j for (k, j), c in zip(items, chosen, strict=True) if c}
    out = []
    for k, r in enumerate(rows):
        o = r["options"][pick[k]] if pick.get(k) is not None else None
        row = dict(r, bits=8 if k in pick and o is None else 4)
        if "options" in r:
            row.update(rows8=o["rows8"] if o else 0, params8=o["params8"] if o else 0,
                       chosen_bytes=o["bytes"] if o else r["bytes"][str(row["bits"])],
                       chosen_increase=o["increase"] if o else None)
        out.append(row)
    if any(r.get("rows8") for r in out) and head_order is None:
        raise ValueError("a plan with head rows at 8 bits needs the analysis's row order")
    layer = [r.get("chosen_bytes") or r["bytes"][str(r["bits"])] for r in out]
    inc = sum(r["chosen_increase"] if r.get("rows8") else r["increase"]["4"] if r["bits"] == 4 else i8
              for r, i8 in zip(out, inc8, strict=True))
    own = sum(r["bits"] * r["params"] + 4 * r.get("params8", 0) for r in out)
    stored = 8 * sum(b - r.get("bias_bytes", 0) for r, b in zip(out, layer, strict=True)) / params
    head8 = next((sorted(head_order[:r["rows8"]]) for r in out if r.get("rows8")), [])
    return Plan(out, budget, fixed + sum(layer), fixed, own / params, inc, sum(r["increase"]["4"] for r in rows),
                exact, notes, stored_bits=stored, head_rows8=head8)


def _extra(row: dict, option: int | None, own_bits: bool) -> int:
    """What moving `row` from 4 bits to `option` (None: the whole layer at 8) costs: own bits or bytes."""
    if option is None:
        return 4 * row["params"] if own_bits else row["bytes"]["8"] - row["bytes"]["4"]
    o = row["options"][option]
    return 4 * o["params8"] if own_bits else o["bytes"] - row["bytes"]["4"]


def planned_bits(model: nn.Module) -> tuple[float, float]:
    """(own, stored) bits per planned weight (every block Linear and the tied embedding / head) of
    a float or weight-only model: own = each weight's width (4, 8, 16, 32; what `--avg-bits`
    budgets), stored = the layers' bytes without biases (weights, group scales, zeros, AWQ input
    scales) x 8 / weights: what each planned weight costs in the file `--max-bytes` counts."""
    own = stored = params = 0
    for _, layer in planned_layers(model):
        tables = [m for m in layer.modules() if isinstance(m, WeightOnlyLinear)] or [layer]  # a split head: two
        for mod in tables:
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
            "layer_bits": plan.layer_bits, "head_rows8": len(plan.head_rows8), "layers": plan.rows, **(extra or {})}


def plan_markdown(plan: Plan, metric: str = "") -> str:
    """quant_plan.md: the budget, the totals and one row per layer."""
    n8 = sum(r["bits"] == 8 for r in plan.rows)
    lines = [f"# Mixed-precision plan ({plan.budget})", "",
             f"{n8} of {len(plan.rows)} layers at 8 bits, the rest at 4; {plan.avg_bits:.3f} bits per planned "
             f"weight ({plan.stored_bits:.3f} as stored, with the group scales and zeros); {plan.total_bytes} bytes "
             f"of tensors ({plan.fixed_bytes} outside the planned layers).",
             f"Summed measured increase{' (' + metric + ')' if metric else ''}: {plan.increase:.6g} "
             f"(every layer at 4 bits: {plan.uniform4_increase:.6g}).",
             *([f"The head's {len(plan.head_rows8)} top-ranked rows (the analysis's ranking: by the calibration text's "
                "token counts) at 8 bits, the others at 4 (the rows: "
                "weight_only.json `head_rows8`)."] if plan.head_rows8 else []),
             *(f"Note: {n}." for n in plan.notes), "",
             "| layer | params | bits | bytes | increase@4 | increase@8 |", "|---|---:|---:|---:|---:|---:|"]
    for r in plan.rows:
        bits = f"4, {r['rows8']} rows at 8 (increase {_f(r['chosen_increase'])})" if r.get("rows8") else r["bits"]
        lines.append(f"| {r['name']} | {r['params']} | {bits} | {r.get('chosen_bytes') or r['bytes'][str(r['bits'])]} | "
                     f"{_f(r['increase']['4'])} | {_f(r['increase']['8'])} |")
    return "\n".join(lines) + "\n"


def write_plan(plan: Plan, d: str | Path, metric: str = "", extra: dict | None = None) -> list[Path]:
    d = Path(d)
    (d / PLAN_JSON).write_text(json.dumps(plan_json(plan, extra), indent=1) + "\n", encoding="utf-8")
    (d / PLAN_MD).write_text(plan_markdown(plan, metric), encoding="utf-8")
    return [d / PLAN_JSON, d / PLAN_MD]
