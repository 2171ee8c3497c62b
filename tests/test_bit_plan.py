"""The mixed-precision knapsack (compress/bit_plan.py) against brute force over every subset."""

from __future__ import annotations

import itertools
import random

import pytest

from gptforge.compress import bit_plan
from gptforge.compress.bit_plan import InfeasibleBudget, knapsack, make_plan


def _brute(costs, gains, capacity):
    best = 0.0
    for pick in itertools.product((False, True), repeat=len(costs)):
        c = sum(x for x, p in zip(costs, pick, strict=True) if p)
        if c <= capacity:
            best = max(best, sum(g for g, p in zip(gains, pick, strict=True) if p))
    return best


def _gain(costs, gains, chosen):
    return sum(g for g, c in zip(gains, chosen, strict=True) if c), sum(x for x, c in zip(costs, chosen, strict=True) if c)


@pytest.mark.parametrize("seed", range(60))
def test_knapsack_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    # small integer costs (zeros too) and gains from a short list: many ties, some gains <= 0
    costs = [rng.choice([0, 1, 2, 3, 4, 6, 8, 12]) * rng.choice([1, 1, 7]) for _ in range(n)]
    gains = [rng.choice([-1.0, 0.0, 0.5, 1.0, 1.0, 2.0, 3.5]) for _ in range(n)]
    capacity = rng.randint(0, sum(costs) + 2)
    chosen, exact = knapsack(costs, gains, capacity)
    got, spent = _gain(costs, gains, chosen)
    assert exact
    assert spent <= capacity
    assert got == pytest.approx(_brute(costs, gains, capacity), abs=1e-12)
    assert not any(c and g <= 0 for c, g in zip(chosen, gains, strict=True))  # useless upgrades never bought


def test_knapsack_with_large_common_factor_and_buckets():
    costs = [589824 * k for k in (3, 1, 4, 1, 5, 9, 2, 6)]  # layer-sized costs: the gcd keeps the table small
    gains = [3.0, 1.2, 4.1, 0.9, 5.3, 8.8, 2.2, 6.5]
    cap = 589824 * 12
    chosen, exact = knapsack(costs, gains, cap)
    assert exact and _gain(costs, gains, chosen)[0] == pytest.approx(_brute(costs, gains, cap))
    # co-prime costs and a tiny table: bucketed, still within the budget, and never worse than nothing
    costs = [1_000_003, 999_983, 2_000_029, 1_500_007]
    chosen, exact = knapsack(costs, [1.0, 1.0, 2.5, 1.6], 3_000_000, max_cells=40)
    got, spent = _gain(costs, [1.0, 1.0, 2.5, 1.6], chosen)
    assert not exact and spent <= 3_000_000 and got > 0


def _rows(rng, n):
    rows = []
    for i in range(n):
        p = rng.choice([64, 128, 256, 1024])
        b4 = p // 2 + 4 * (p // 32)
        rows.append({"name": f"l{i}", "params": p, "bytes": {"4": b4, "8": p + 4 * (p // 32)}, "float_bytes": 4 * p,
                     "increase": {"4": rng.choice([0.1, 0.2, 0.2, 1.0, 3.0]), "8": rng.choice([0.0, 0.01, None])}})
    return rows


@pytest.mark.parametrize("seed", range(25))
def test_plan_is_optimal_and_within_the_budget(seed):
    rng = random.Random(seed)
    rows = _rows(rng, rng.randint(1, 8))
    fixed = rng.randint(0, 500)
    params = sum(r["params"] for r in rows)
    inc8 = [r["increase"]["8"] or 0.0 for r in rows]
    # every assignment, to check the plan's objective and its budget
    options = [(sum(r["bytes"][str(b)] for r, b in zip(rows, bits, strict=True)) + fixed,
                sum(b * r["params"] for r, b in zip(rows, bits, strict=True)),
                sum(r["increase"]["4"] if b == 4 else i8 for r, b, i8 in zip(rows, bits, inc8, strict=True)))
               for bits in itertools.product((4, 8), repeat=len(rows))]
    B = rng.choice([4.0, 4.5, 5.0, 6.25, 8.0])
    plan = make_plan(rows, fixed, avg_bits=B)
    assert sum(r["bits"] * r["params"] for r in plan.rows) <= B * params
    assert plan.avg_bits <= B + 1e-12
    assert plan.increase == pytest.approx(min(inc for _, bits, inc in options if bits <= B * params), abs=1e-12)
    N = rng.randint(min(o[0] for o in options), max(o[0] for o in options))
    plan = make_plan(rows, fixed, max_bytes=N)
    assert plan.total_bytes <= N
    assert plan.total_bytes == fixed + sum(r["bytes"][str(r["bits"])] for r in plan.rows)
    assert plan.increase == pytest.approx(min(inc for size, _, inc in options if size <= N), abs=1e-12)
    assert plan.uniform4_increase == pytest.approx(sum(r["increase"]["4"] for r in rows))
    # group 32 with 4-byte scales: one stored bit per weight more than its own bits, at 4 and at 8
    assert plan.stored_bits == pytest.approx(plan.avg_bits + 1, abs=1e-12)


def test_stored_bits_exclude_biases_and_count_scales():
    # 64 x 32 at 4 bits in groups of 32 (one fp32 scale per row and group) with a 64-float bias
    row = {"name": "l", "params": 2048, "bias_bytes": 256, "bytes": {"4": 1024 + 256 + 256, "8": 2048 + 256 + 256},
           "float_bytes": 4 * 2048 + 256, "increase": {"4": 1.0, "8": 0.0}}
    plan = make_plan([row], 0, avg_bits=4)
    assert (plan.avg_bits, plan.stored_bits, plan.total_bytes) == (4, 5, 1536)
    plan = make_plan([row], 0, avg_bits=8)
    assert (plan.avg_bits, plan.stored_bits, plan.total_bytes) == (8, 9, 2560)
    assert bit_plan.plan_json(plan)["stored_bits"] == 9
    assert "8.000 bits per planned weight (9.000 as stored" in bit_plan.plan_markdown(plan)


def test_infeasible_budgets_name_the_minimum():
    rows = _rows(random.Random(0), 3)
    least = 100 + sum(r["bytes"]["4"] for r in rows)
    with pytest.raises(InfeasibleBudget, match=f"give --max-bytes {least} or more") as e:
        make_plan(rows, 100, max_bytes=least - 1)
    assert e.value.minimum == least
    assert all(r["bits"] == 4 for r in make_plan(rows, 100, max_bytes=least).rows)
    with pytest.raises(InfeasibleBudget, match="--avg-bits 3.5: below 4"):
        make_plan(rows, 100, avg_bits=3.5)
    with pytest.raises(bit_plan.UsageError, match="one budget"):
        make_plan(rows, 100, avg_bits=5, max_bytes=10**9)


def _brute_groups(costs, gains, groups, capacity):
    best = 0.0
    options = {}
    for i, g in enumerate(groups):
        options.setdefault(g, [None]).append(i)
    for pick in itertools.product(*options.values()):
        chosen = [i for i in pick if i is not None]
        if sum(costs[i] for i in chosen) <= capacity:
            best = max(best, sum(gains[i] for i in chosen))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_knapsack_with_groups_takes_at_most_one_per_group_and_equals_brute_force(seed):
    """The head's options (its top k rows at 8 bits, or all) are one group: at most one is bought."""
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    groups = [rng.randint(0, 3) for _ in range(n)]
    costs = [rng.choice([0, 1, 2, 3, 5, 8]) * rng.choice([1, 4]) for _ in range(n)]
    gains = [rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0, 3.5, 4.0]) for _ in range(n)]
    capacity = rng.randint(0, sum(costs) + 2)
    chosen, exact = knapsack(costs, gains, capacity, groups=groups)
    got, spent = _gain(costs, gains, chosen)
    assert exact and spent <= capacity
    assert all(sum(c for c, g in zip(chosen, groups, strict=True) if g == k) <= 1 for k in set(groups))
    assert got == pytest.approx(_brute_groups(costs, gains, groups, capacity), abs=1e-12)


def test_plan_buys_head_rows_when_the_whole_head_does_not_fit():
    """A head too large for the budget at 8 bits still gets its most useful rows at 8."""
    def row(name, params, inc4, options=()):
        return {"name": name, "params": params, "bytes": {"4": params // 2, "8": params}, "float_bytes": 4 * params,
                "increase": {"4": inc4, "8": 0.0}, **({"options": list(options)} if options else {})}

    vocab, dim = 64, 16
    head = row("wte", vocab * dim, 1.0, [{"rows8": k, "params8": k * dim, "increase": inc,
                                          "bytes": vocab * dim // 2 + k * dim // 2}
                                         for k, inc in ((8, 0.4), (16, 0.2), (32, 0.1))])
    rows = [row("a", 512, 0.05), head]
    order = list(range(vocab))[::-1]
    plan = make_plan(rows, 0, avg_bits=5.0, head_order=order)  # 0.25 bits x 1536 = 1536 extra: 24 head rows
    got = {r["name"]: r for r in plan.rows}
    assert got["wte"]["bits"] == 4 and got["wte"]["rows8"] == 16 and got["a"]["bits"] == 4
    assert plan.head_rows8 == sorted(order[:16]) and plan.increase == pytest.approx(0.25)
    assert plan.avg_bits == pytest.approx((4 * 1536 + 4 * 16 * dim) / 1536) and plan.avg_bits <= 5.0
    assert "16 rows at 8" in bit_plan.plan_markdown(plan) and bit_plan.plan_json(plan)["head_rows8"] == 16
    assert make_plan(rows, 0, avg_bits=8, head_order=order).layer_bits == {"a": 8, "wte": 8}
