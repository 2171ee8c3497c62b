"""Mixed precision from sensitivity: `analyze --weights int4`, `quantize --avg-bits / --max-bytes`,
and a mixed 4/8-bit model directory (per-layer bit-widths in weight_only.json). The model's
outputs are checked against a plain float model whose weights are rounded here with the same
integer arithmetic (fp32 kernel), and the plan's byte count against the saved tensors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gptforge.transforms import lowbit
from gptforge.transforms.weight_only import KERNEL_ENV, WeightOnlySpec, planned_layers

pytestmark = pytest.mark.usefixtures("one_thread")
CALIB = ("--samples", "4", "--seq-len", "32", "--group-size", "32")


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    from gf_testutil import tiny_model
    from gptforge.model_io import save_model_dir
    from test_train_support import small_tokenizer

    torch.manual_seed(0)
    m, cfg = tiny_model()
    d = tmp_path_factory.mktemp("mixed") / "float"
    save_model_dir(m, cfg, d, small_tokenizer())
    text = d.parent / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog and runs far away. " * 60)
    return d, text


@pytest.fixture(scope="module")
def analysis(float_dir):
    """analysis.json of `gptforge analyze --weights int4` on the tiny model (run once)."""
    from gptforge.cli import main

    src, text = float_dir
    out = src.parent / "analysis"
    assert main(["analyze", "--ckpt", str(src), "--weights", "int4", "--calib", str(text), *CALIB, "--out", str(out),
                 "--no-progress"]) == 0
    return out / "analysis.json"


def test_analyze_has_one_finite_row_per_linear_and_the_head(float_dir, analysis, run_cli):
    from gptforge.model_io import load_model

    m, _ = load_model(float_dir[0])
    names = [n for n, _ in planned_layers(m)]
    assert len(names) == 4 * len(m.blocks) + 1 and names[-1] == "wte"
    state = json.loads(analysis.read_text())
    assert state["mode"] == "weights" and state["metric"] == "kl" and state["complete"]
    assert sorted(state["layers"]) == sorted(names)
    rows = {r["name"]: r for r in state["weights"]["rows"]}
    for n in names:
        r = state["layers"][n]
        assert math.isfinite(r["sensitivity"]) and math.isfinite(r["sensitivity8"])
        assert rows[n]["bytes"]["4"] < rows[n]["bytes"]["8"]
    # rounding to 4 bits hurts more than to 8, and the head (the largest layer here) most
    assert sum(r["sensitivity"] for r in state["layers"].values()) > 10 * sum(
        abs(r["sensitivity8"]) for r in state["layers"].values())
    assert max(state["layers"], key=lambda n: state["layers"][n]["sensitivity"]) == "wte"
    txt = (analysis.parent / "analysis.txt").read_text()
    assert all(n in txt for n in names)
    # the head's rows: a ranking of every row and the measured ladder, more rows at 8 bits costing less
    hr = state["head_rows"]
    vocab = m.wte.num_embeddings
    assert hr["score"] == "counts+fisher" and sorted(hr["order"]) == list(range(vocab)) and len(hr["counts"]) == 16
    ks = [r["rows8"] for r in hr["ladder"]]
    assert ks == sorted(ks) and ks[0] > 0 and ks[-1] < vocab and len(ks) >= 8
    inc = [r["increase"] for r in hr["ladder"]]
    assert inc[-1] < inc[0] < state["layers"]["wte"]["sensitivity"] and inc[-1] > state["layers"]["wte"]["sensitivity8"]
    assert f"rows8: increase): {ks[0]}: " in txt
    # the same command again resumes every layer from the state file
    src, text = float_dir
    code, out, err = run_cli("analyze", "--ckpt", src, "--weights", "int4", "--calib", text, *CALIB,
                             "--out", analysis.parent, "--no-progress")
    assert code == 0, err
    assert f"({len(names)} layers resumed)" in out


def test_head_rows_are_ranked_by_the_calibration_texts_token_counts(float_dir, analysis, run_cli, tmp_path):
    """The ranking puts the calibration text's most frequent tokens first; an analysis ranked
    before the counts (score "fisher") is ranked and measured again when it resumes, its layers not."""
    import shutil

    from gptforge.compress.head_rows import counts_digest, token_counts
    from gptforge.compress.weight_only_run import calibration_tokens, load_float_model

    src, text = float_dir
    model, _, tok, _ = load_float_model(src)
    counts = token_counts(calibration_tokens(tok, text, 0), model.wte.num_embeddings)
    hr = json.loads(analysis.read_text())["head_rows"]
    seen = int((counts > 0).sum())
    assert hr["counts"] == counts_digest(counts) and 0 < seen < len(counts)
    assert [int(counts[v]) for v in hr["order"][:seen]] == sorted(counts[counts > 0].tolist(), reverse=True)
    old = tmp_path / "old"
    shutil.copytree(analysis.parent, old)
    state = json.loads((old / "analysis.json").read_text())
    state["head_rows"] = {"score": "fisher", "order": hr["order"][::-1],
                          "ladder": [{"rows8": r["rows8"], "increase": 1.0} for r in hr["ladder"]]}
    (old / "analysis.json").write_text(json.dumps(state))
    code, out, err = run_cli("analyze", "--ckpt", src, "--weights", "int4", "--calib", text, *CALIB,
                             "--out", old, "--no-progress")
    assert code == 0, err
    assert f"({len(state['layers'])} layers resumed)" in out
    again = json.loads((old / "analysis.json").read_text())["head_rows"]
    assert again["order"] == hr["order"] and again["counts"] == hr["counts"]
    assert [r["increase"] for r in again["ladder"]] == pytest.approx([r["increase"] for r in hr["ladder"]])


def test_the_metric_is_zero_on_the_float_model_and_loss_works(float_dir):
    from gptforge.compress.sensitivity_weights import build_metric, calibration_batches, weight_sensitivity
    from gptforge.compress.weight_only_run import calibration_ids, load_float_model

    model, _, tok, _ = load_float_model(float_dir[0])
    b = calibration_batches(calibration_ids(tok, float_dir[1], 3, 17))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    a = weight_sensitivity(model, WeightOnlySpec(group_size=32), b, metric="loss", method="gptq",
                           eight_bits=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # restored exactly
    assert a.metric == "loss" and all(math.isfinite(r.sensitivity) and r.sensitivity8 is None
                                      for r in a.layers.values())
    assert build_metric(model, b, "kl")(model) == pytest.approx(0.0, abs=1e-7)


def test_analyze_loss_metric_with_gptq_from_the_cli(float_dir, run_cli, tmp_path):
    src, text = float_dir
    code, out, err = run_cli("analyze", "--ckpt", src, "--weights", "int4", "--metric", "loss", "--method", "gptq",
                             "--calib", text, *CALIB, "--out", tmp_path / "a", "--no-progress", "--show", "3")
    assert code == 0, err
    assert "(gptq), mean token loss" in out and "... 6 more" in out
    state = json.loads((tmp_path / "a" / "analysis.json").read_text())
    assert state["metric"] == "loss" and state["fingerprint"]["weights"]["method"] == "gptq"
    assert all(math.isfinite(r["sensitivity"]) for r in state["layers"].values())


def test_analyze_with_clip_search_rounds_as_quantize_will(float_dir, run_cli, tmp_path):
    from gptforge.compress.sensitivity_weights import rounded_weight

    src, text = float_dir
    states = []
    for extra in ((), ("--clip-search",)):
        code, out, err = run_cli("analyze", "--ckpt", src, "--weights", "int4", "--group-size", "32", "--calib", text,
                                 *CALIB, "--out", tmp_path / f"a{len(extra)}", "--no-progress", *extra)
        assert code == 0, err
        assert ("clip-searched grids" in out) is bool(extra)
        states.append(json.loads((tmp_path / f"a{len(extra)}" / "analysis.json").read_text()))
    # recorded only when on, so an analysis written before the flag existed still resumes
    assert "clip" not in states[0]["fingerprint"]["weights"] and states[1]["fingerprint"]["weights"]["clip"]
    assert states[0]["layers"] != states[1]["layers"]  # measured on other grids
    torch.manual_seed(0)
    w = torch.randn(8, 64) * torch.rand(8, 64).pow(4)
    spec = WeightOnlySpec(bits=4, group_size=32, clip=True)
    q, s, z = lowbit.quantize_rtn(w, 4, 32, True, clip=True)
    assert torch.equal(rounded_weight(w, 4, spec), lowbit.dequantize(q, s, z, 32))


def _rounded(w, bits):
    q, s, z = lowbit.quantize_rtn(w, bits, 32, True)
    return lowbit.dequantize(q, s, z, 32)


def test_mixed_model_round_trips_and_equals_the_plan_applied_in_memory(float_dir, analysis, run_cli, tmp_path,
                                                                       monkeypatch):
    from gptforge.compress.bit_plan import PLAN_JSON, PLAN_MD
    from gptforge.model_io import load_model
    from gptforge.transforms.weight_only import quantize_rtn_model, read_spec

    monkeypatch.setenv(KERNEL_ENV, "fp32")
    src, text = float_dir
    out = tmp_path / "mixed"
    code, stdout, err = run_cli("quantize", "--ckpt", src, "--out", out, "--weights", "int4", "--group-size", "32",
                                "--avg-bits", "4.6", "--sensitivity", analysis)
    assert code == 0, err
    assert "mixed 4/8 bits" in stdout and f"head 4 bits with its {plan_rows(out)} most used rows at 8" in stdout
    plan = json.loads((out / PLAN_JSON).read_text())
    assert (out / PLAN_MD).read_text().startswith("# Mixed-precision plan (--avg-bits 4.6)")
    bits = plan["layer_bits"]
    assert set(bits.values()) == {4, 8} and plan["avg_bits"] <= 4.6
    assert read_spec(out).layer_bits == bits
    # the file's head_bits agrees with the plan's head, and both bit counts are on record
    saved = json.loads((out / "weight_only.json").read_text())
    assert saved["head_bits"] == bits["wte"] == read_spec(out).bits_for("wte")
    assert saved["avg_bits"] == pytest.approx(plan["avg_bits"]) and saved["stored_bits"] == pytest.approx(
        plan["stored_bits"])
    assert f"{plan['avg_bits']:.3f} bits per planned weight ({plan['stored_bits']:.3f} stored with scales)" in stdout
    q, _ = load_model(out)
    rows8 = read_spec(out).head_rows8
    # the tiny model's head is most of its weights: at 4.6 bits the plan keeps its most used rows at 8
    assert 0 < len(rows8) == plan["head_rows8"] < q.wte.num_embeddings and list(rows8) == sorted(set(rows8))
    assert saved["head_rows8"] == list(rows8) and torch.equal(q.wte.rows8, torch.tensor(rows8))
    for name, mod in planned_layers(q):
        if name != "wte":
            assert mod.bits == bits[name], name
    assert (q.wte.hot.bits, q.wte.cold.bits) == (8, 4)
    assert plan["total_bytes"] == sum(t.numel() * t.element_size() for t in q.state_dict().values())
    _check_bits(q, bits, plan, rows8)
    # the plan applied in memory: quantize_rtn_model with the same per-layer bits and head rows
    mem, _ = load_model(src)
    quantize_rtn_model(mem, WeightOnlySpec(bits=4, group_size=32, layer_bits=bits, head_rows8=rows8))
    # and a reference no weight-only module computes: a float model with each weight (each head row) rounded here
    ref, _ = load_model(src)
    with torch.no_grad():
        for name, mod in planned_layers(ref):
            w = mod.weight
            w.copy_(_rounded(w.float(), bits[name]))
        hot = list(rows8)
        ref.wte.weight[hot] = _rounded(load_model(src)[0].wte.weight[hot].float(), 8)
    ids = torch.randint(0, 4096, (2, 16))
    with torch.no_grad():
        lq, lm, lr = q(ids).logits, mem(ids).logits, ref(ids).logits
    assert torch.equal(lq, lm)
    torch.testing.assert_close(lq, lr, rtol=1e-5, atol=1e-5)
    code, stdout, err = run_cli("generate", "--ckpt", out, "--prompt", "the quick", "-o",
                                "Generation.decode_strategy=greedy_search", "-o", "Generation.max_dec_len=3",
                                "--no-stream")
    assert code == 0 and stdout.startswith("the quick"), err
    code, stdout, err = run_cli("quantize", "--ckpt", out)  # the per-layer table shows both widths
    assert code == 0 and "int4 sym group 32" in stdout and "int8 sym group 32" in stdout, err


def plan_rows(out) -> int:
    return json.loads((out / "quant_plan.json").read_text())["head_rows8"]


def _check_bits(q, bits, plan, rows8=()):
    """The plan's two bit counts, recounted here from the loaded model's tensors."""
    n = own = stored = 0
    tables = [(n, m, bits[n]) for n, m in planned_layers(q) if n != "wte"]
    tables += [("wte.hot", q.wte.hot, 8), ("wte.cold", q.wte.cold, 4)] if rows8 else [("wte", q.wte, bits["wte"])]
    for name, mod, b in tables:
        k = mod.in_features * mod.out_features
        n, own = n + k, own + b * k
        # packed weight + fp32 scales (groups of 32), no zeros (symmetric); biases are not weights
        assert set(mod.state_dict()) - {"bias"} == {"weight", "weight_scale"}, name
        stored += 8 * (mod.weight.numel() * mod.weight.element_size() + 4 * mod.weight_scale.numel())
    assert plan["avg_bits"] == pytest.approx(own / n) and plan["stored_bits"] == pytest.approx(stored / n)
    assert plan["stored_bits"] == pytest.approx(plan["avg_bits"] + 1)  # a 32-bit scale per 32 weights


def test_uniform_run_reports_both_bit_counts(float_dir, run_cli, tmp_path):
    from gptforge.model_io import load_model

    src, _ = float_dir
    out = tmp_path / "u"
    code, stdout, err = run_cli("quantize", "--ckpt", src, "--out", out, "--weights", "int4", "--group-size", "32")
    assert code == 0, err
    saved = json.loads((out / "weight_only.json").read_text())
    m, _ = load_model(src)
    sizes = {n: mod.weight.numel() for n, mod in planned_layers(m)}
    head = sizes["wte"] / sum(sizes.values())
    # the default head at 8 bits: 4 + 4 x (the head's share) own bits, one more with the scales
    assert saved["head_bits"] == 8 and saved["avg_bits"] == pytest.approx(4 + 4 * head)
    assert saved["stored_bits"] == pytest.approx(5 + 4 * head)
    assert f"{saved['avg_bits']:.3f} bits per planned weight ({saved['stored_bits']:.3f} stored" in stdout


def test_max_bytes_measured_on_the_fly_fits(float_dir, run_cli, tmp_path):
    src, text = float_dir
    out = tmp_path / "mb"
    code, stdout, err = run_cli("quantize", "--ckpt", src, "--out", out, "--weights", "int4", "--calib", text,
                                *CALIB, "--max-bytes", "330000", "--method", "gptq", "--no-progress")
    assert code == 0, err
    plan = json.loads((out / "quant_plan.json").read_text())
    assert plan["total_bytes"] <= 330000 and "measured by this run" in plan["sensitivity"]
    assert 8 in plan["layer_bits"].values()


def test_a_plan_measured_on_the_fly_ranks_the_head_rows_as_analyze_does(float_dir, analysis, run_cli, tmp_path):
    """`quantize --avg-bits` without --sensitivity measures the analysis itself, the head's rows
    ranked by the same token counts: its 8-bit rows are the top of `analyze`'s ranking."""
    from gptforge.transforms.weight_only import read_spec

    src, text = float_dir
    out = tmp_path / "fly"
    code, _, err = run_cli("quantize", "--ckpt", src, "--out", out, "--weights", "int4", "--calib", text, *CALIB,
                           "--avg-bits", "4.6", "--no-progress")
    assert code == 0, err
    rows8 = read_spec(out).head_rows8
    order = json.loads(analysis.read_text())["head_rows"]["order"]
    assert len(rows8) > 0 and list(rows8) == sorted(order[: len(rows8)])


@pytest.mark.parametrize("extra,needle", [
    (("--weights", "int8", "--avg-bits", "5"), "--weights int4"),
    (("--weights", "int4", "--avg-bits", "5", "--max-bytes", "9"), "one"),
    (("--weights", "int4", "--avg-bits", "5", "--head-bits", "8"), "--head-bits"),
    (("--weights", "int4", "--sensitivity", "S"), "--sensitivity applies"),
    (("--avg-bits", "5",), "--avg-bits applies with --weights"),
    (("--weights", "int4", "--group-size", "32", "--avg-bits", "3"), "below 4"),
    (("--weights", "int4", "--group-size", "32", "--max-bytes", "1000", "--sensitivity", "S"),
     "below the smallest model this plan can make"),
    (("--weights", "int4", "--group-size", "32", "--max-bytes", "1000"), "(every layer at 4 bits)"),  # before measuring
    (("--weights", "int4", "--group-size", "64", "--avg-bits", "5", "--sensitivity", "S"), "group_size 32"),
    (("--weights", "int4", "--group-size", "32", "--avg-bits", "5", "--sensitivity", "MISSING"), "unreadable"),
])
def test_quantize_plan_errors_are_one_line(float_dir, analysis, run_cli, tmp_path, extra, needle):
    subst = {"S": str(analysis), "MISSING": str(tmp_path / "none.json")}
    code, _, err = run_cli("quantize", "--ckpt", float_dir[0], "--out", tmp_path / "o",
                           *(subst.get(a, a) for a in extra))
    assert code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("damage", [{"order": [0, 0]}, {"ladder": [{"rows8": "x", "increase": 1}]},
                                    {"ladder": []}, {"order": "abc"}])
def test_a_damaged_head_row_ladder_is_one_line(float_dir, analysis, run_cli, tmp_path, damage):
    state = json.loads(analysis.read_text())
    state["head_rows"].update(damage)
    bad = tmp_path / "analysis.json"
    bad.write_text(json.dumps(state))
    code, _, err = run_cli("quantize", "--ckpt", float_dir[0], "--out", tmp_path / "o", "--weights", "int4",
                           "--group-size", "32", "--avg-bits", "4.6", "--sensitivity", bad)
    assert code == 2, err
    assert f"--sensitivity {bad}: head_rows is damaged" in err and len(err.strip().splitlines()) == 1


def test_sensitivity_of_another_model_is_refused(float_dir, analysis, run_cli, tmp_path):
    from gf_testutil import tiny_model
    from gptforge.model_io import save_model_dir
    from test_train_support import small_tokenizer

    torch.manual_seed(1)
    m, cfg = tiny_model()
    other = tmp_path / "other"
    save_model_dir(m, cfg, other, small_tokenizer())
    code, _, err = run_cli("quantize", "--ckpt", other, "--out", tmp_path / "o", "--weights", "int4",
                           "--group-size", "32", "--avg-bits", "5", "--sensitivity", analysis)
    assert code == 2 and "analyses another model" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra,needle", [
    (("--weights", "int4", "--top-k", "3"), "--top-k"),
    (("--weights", "int4", "--metric", "cosine"), "--metric cosine"),
    (("--weights", "int4", "--mode", "ptq"), "--mode"),
    (("--group-size", "32",), "--group-size applies with --weights"),
    (("--clip-search",), "--clip-search applies with --weights"),
])
def test_analyze_weight_flag_errors_are_one_line(float_dir, run_cli, tmp_path, extra, needle):
    code, _, err = run_cli("analyze", "--ckpt", float_dir[0], "--out", tmp_path / "a", *extra)
    assert code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1
