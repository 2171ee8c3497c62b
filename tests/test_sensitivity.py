"""Quantization sensitivity analysis (`gptforge.compress.sensitivity`): planted outliers in a
trained tiny model are found first by every metric and in both modes, a de-quantized layer is
exactly the model an independent construction gives, the metrics agree with torch's own
functions, and an interrupted analysis resumes to the same ranking."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptforge.compress import sensitivity as sens
from gptforge.compress.ptq import calibrate, ptq
from gptforge.compress.sensitivity_run import run_analysis, split_batches
from gptforge.config.schema import QuantizationConfig
from gptforge.errors import CheckpointError, UsageError
from gptforge.model_io import load_model, load_run_config, save_model_dir
from gptforge.train import pretrain
from gptforge.transforms.quant import quant_modules, quantize_model
from test_train_support import small_tokenizer, train_config

PLANTED = {"weight": "blocks.0.linear2", "act": "blocks.1.attn.qkv_proj"}


def plant(model: nn.Module, kind: str) -> str:
    """Give one layer an outlier that ruins its 8-bit quantization and not the float model;
    returns the layer's name.

    weight: the FFN neuron of block 0 with the smallest outgoing weights is switched off (bias -100: GELU gives exactly 0; the model
    loses one of its 256 neurons) and its outgoing column in linear2 gets a weight 1000x the
    largest, which changes nothing in float, but every row's abs-max step is huge and the other
    weights of linear2 quantize to zero.
    act: channel 5 of block 1's first LayerNorm is scaled x1000 and qkv_proj's input column /1000,
    so qkv_proj's input range is set by one channel and every other channel quantizes to zero.
    """
    with torch.no_grad():
        if kind == "weight":
            blk = model.blocks[0]
            j = int(blk.linear2.weight.norm(dim=0).argmin())  # the neuron that matters least
            blk.linear1.bias[j] = -100.0
            blk.linear2.weight[:, j] = 1000.0 * blk.linear2.weight.abs().max()
        else:
            blk, c = model.blocks[1], 5
            blk.norm1.weight[c] *= 1000.0
            blk.norm1.bias[c] *= 1000.0
            blk.attn.qkv_proj.weight[:, c] /= 1000.0
    return PLANTED[kind]


pytestmark = pytest.mark.usefixtures("one_thread")


SENTENCES = ["the quick brown fox jumps over the lazy dog.", "pack my box with five dozen liquor jugs.",
             "sphinx of black quartz, judge my vow."]


def text_corpus(root, tok, n_docs: int = 1000):
    """Token files of documents made of 1-3 of the SENTENCES (which the tiny model learns)."""
    rng = np.random.RandomState(0)
    docs = [np.array(tok.encode(" ".join(SENTENCES[i] for i in rng.randint(0, 3, size=rng.randint(1, 4))))
                     + [tok.eos_token_id]) for _ in range(n_docs)]
    root.mkdir(parents=True, exist_ok=True)
    np.save(root / "text_ids.npy", np.concatenate(docs).astype(np.uint16))
    np.savez(root / "text_idx.npz", lens=np.array([len(d) for d in docs], dtype=np.int32),
             docs=np.arange(n_docs + 1, dtype=np.int64))
    return root / "text"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(root, tokenizer, float checkpoint) of a tiny model that has learned the SENTENCES
    (200 steps: LAMBADA accuracy 100%, WikiText-style ppl ~3 on them)."""
    root = tmp_path_factory.mktemp("sens")
    tok = small_tokenizer()
    prefix = text_corpus(root / "text", tok)
    cfg = train_config(root, "Engine.save_load.save_steps=-1", "Engine.eval_freq=1000",
                       *(f"Data.{s}.dataset.input_dir={prefix}" for s in ("Train", "Eval")), steps=200)
    pretrain(cfg, tokenizer=tok, progress=False, echo=False)
    return root, tok, root / "out" / "step_200"


def eval_files(tmp_path):
    """(LAMBADA jsonl, WikiText-style text) made of the SENTENCES."""
    lam = tmp_path / "lambada.jsonl"
    lines = [a.rstrip(".") for a in SENTENCES] + [f"{a} {b.rstrip('.')}" for a in SENTENCES for b in SENTENCES]
    lam.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    wiki = tmp_path / "wiki.txt"
    wiki.write_text(" ".join(SENTENCES[i] for i in np.random.RandomState(1).randint(0, 3, size=40)) + "\n")
    return lam, wiki


@pytest.fixture(scope="module")
def planted(trained):
    """{kind: (planted float dir, its PTQ-calibrated fake-quant dir)}."""
    root, tok, ckpt = trained
    out = {}
    for kind in PLANTED:
        model, cfg = load_model(ckpt)
        ref = model(torch.arange(20)[None]).logits
        plant(model, kind)
        # act: the same function up to rounding; weight: one of 256 FFN neurons of block 0 removed
        torch.testing.assert_close(model(torch.arange(20)[None]).logits, ref, rtol=0, atol=1e-4 if kind == "act" else 0.1)
        fdir = save_model_dir(model, cfg, root / f"float_{kind}", tok)
        cfg.Compress.Quantization.calib_batches = 4
        ptq(cfg, root / f"ptq_{kind}", source=fdir, tokenizer=tok, progress=False, echo=False)
        out[kind] = (fdir, root / f"ptq_{kind}")
    return out


def _cfg(ckpt, *overrides):

    return load_run_config(overrides=list(overrides), ckpt_dir=ckpt)


@pytest.mark.parametrize("kind", sorted(PLANTED))
@pytest.mark.parametrize("mode", ["qat", "ptq"])
@pytest.mark.parametrize("metric", ["acc", "ppl", "loss", "cosine", "kl"])
def test_planted_outlier_is_ranked_first(planted, trained, tmp_path, kind, mode, metric):
    root, tok, _ = trained
    fdir, qdir = planted[kind]
    over = ["Compress.Quantization.calib_batches=4"]
    lam, wiki = eval_files(tmp_path)
    if metric in ("acc", "ppl"):
        over += [f"Offline_Eval.eval_path={lam if metric == 'acc' else wiki}", "Offline_Eval.max_seq_len=32",
                 "Offline_Eval.overlapping_eval=16"]
    if mode == "qat":
        res = run_analysis(_cfg(qdir, *over), qat_ckpt=qdir, float_ckpt=fdir, metric=metric, batches=4,
                           out_dir=tmp_path / "a", tokenizer=tok, plot=False, progress=False, echo=False)
    else:
        res = run_analysis(_cfg(fdir, *over), float_ckpt=fdir, mode="ptq", metric=metric, batches=4,
                           out_dir=tmp_path / "a", tokenizer=tok, plot=False, progress=False, echo=False)
    ranked = res.analysis.ranked()
    assert len(ranked) == 8 and ranked[0].name == PLANTED[kind], [(r.name, r.sensitivity) for r in ranked]
    assert ranked[0].sensitivity > 0 and ranked[0].sensitivity > 3 * abs(ranked[1].sensitivity)
    if mode == "ptq" and metric in ("cosine", "kl"):
        assert res.analysis.base_value == pytest.approx(0.0, abs=1e-6)  # the float model vs itself


@pytest.fixture(scope="module")
def qat_run(trained, planted):
    """A real (short) QAT run from the weight-planted model: QAT weights differ from the float ones."""
    from gptforge.compress.qat import qat

    root, tok, _ = trained
    fdir = planted["weight"][0]
    cfg = train_config(root, f"Engine.save_load.output_dir={root / 'qat'}", "Engine.eval_freq=100",
                       "Engine.save_load.save_steps=-1", "Optimizer.lr.max_lr=2e-3", steps=3)
    cfg.Compress.pretrained = str(fdir)
    res = qat(cfg, tok, progress=False, echo=False)
    return fdir, res.checkpoint_dir


def _eval_batches(ckpt, tok, n=3):
    return split_batches(load_model(ckpt)[1], tok, "Eval", n)


def test_a_dequantized_layer_is_the_independently_built_model(trained, qat_run):
    """qat mode: the layer-off model = the QAT model with that module replaced by a plain
    nn.Linear holding the float baseline's weight and the QAT bias (the reference's graph edit);
    ptq mode: the only-one-quantized model = quantize_model with every other layer skipped."""
    _, tok, _ = trained
    fdir, qdir = qat_run
    batches = _eval_batches(qdir, tok)
    metric = sens.loss_metric(batches)
    model = load_model(qdir)[0]
    fmodel = load_model(fdir, with_structure=False)[0]
    before = copy.deepcopy(model.state_dict())
    names = list(quant_modules(model))
    fw = sens.float_linear_weights(model, fmodel, names, str(fdir))
    assert not torch.equal(fw["blocks.1.linear1"], model.blocks[1].linear1.weight)  # QAT moved the weights
    res = sens.analyze(model, metric, float_weights=fw)
    assert res.base_value == metric(load_model(qdir)[0])
    for name in ("blocks.0.linear2", "blocks.1.attn.out_proj"):
        ref = load_model(qdir)[0]
        q = ref.get_submodule(name)
        lin = nn.Linear(q.in_features, q.out_features)
        lin.weight.data.copy_(fw[name])
        lin.bias.data.copy_(q.bias)
        parent, _, leaf = name.rpartition(".")
        setattr(ref.get_submodule(parent), leaf, lin)
        assert res.layers[name].value == metric(ref)
        assert res.layers[name].sensitivity == pytest.approx(res.base_value - metric(ref), abs=0)
    after = model.state_dict()  # the analysis leaves the model exactly as it found it
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(m.weight_quant_enabled and m.act_quant_enabled for m in quant_modules(model).values())

    # ptq mode on the float model
    qcfg = QuantizationConfig(enable=True)
    fm = load_model(fdir, with_structure=False)[0]
    quantize_model(fm, qcfg)
    calib = split_batches(load_model(fdir)[1], tok, "Train", 2)
    calibrate(fm, calib)
    res = sens.analyze(fm, metric, mode="ptq")
    assert res.base_value == metric(load_model(fdir, with_structure=False)[0])
    name = "blocks.1.linear1"
    only = load_model(fdir, with_structure=False)[0]
    quantize_model(only, QuantizationConfig(enable=True, skip_layers=[n for n in names if n != name]))
    calibrate(only, calib)
    assert res.layers[name].value == pytest.approx(metric(only), rel=1e-6)
    assert res.layers[name].sensitivity == pytest.approx(metric(only) - res.base_value, rel=1e-4)


def test_metrics_agree_with_torch(trained, planted):
    _, tok, _ = trained
    fdir, qdir = planted["act"]
    batches = _eval_batches(fdir, tok, 2)
    model, fmodel = load_model(qdir)[0], load_model(fdir, with_structure=False)[0]
    with torch.no_grad():
        logits = [model(b["tokens"], position_ids=b["position_ids"]).logits for b in batches]
        flogits = [fmodel(b["tokens"], position_ids=b["position_ids"]).logits for b in batches]
    lab = torch.cat([b["labels"].flatten() for b in batches])
    lg, fl = torch.cat([x.flatten(0, 1) for x in logits]), torch.cat([x.flatten(0, 1) for x in flogits])
    assert sens.loss_metric(batches)(model) == pytest.approx(float(F.cross_entropy(lg, lab)), rel=1e-6)
    ref = sens.reference_outputs(fmodel, batches)
    cos = float((1 - F.cosine_similarity(lg, fl, dim=-1)).mean())
    assert sens.distance_metric(batches, ref, "cosine")(model) == pytest.approx(cos, rel=1e-5)
    kl = float(F.kl_div(F.log_softmax(lg, -1), F.log_softmax(fl, -1), log_target=True, reduction="batchmean"))
    assert sens.distance_metric(batches, ref, "kl")(model) == pytest.approx(kl, rel=1e-5)
    assert sens.distance_metric(batches, ref, "kl")(fmodel) == pytest.approx(0.0, abs=1e-7)


def test_sign_conventions():
    acc = sens.Metric("acc", "", True, lambda m: 0.0)
    ppl = sens.Metric("ppl", "", False, lambda m: 0.0)
    # the seed's numbers: QAT 41.58, the same model without one layer's quantization 44.94
    assert sens.sensitivity_value("qat", acc, 44.94, 41.58) == pytest.approx(3.36)
    assert sens.sensitivity_value("qat", ppl, 20.0, 21.5) == pytest.approx(1.5)  # ppl falls: sensitive
    assert sens.sensitivity_value("ptq", acc, 40.0, 44.17) == pytest.approx(4.17)  # fp - metric
    assert sens.sensitivity_value("ptq", ppl, 23.0, 21.0) == pytest.approx(2.0)


class _Interrupt(sens.Metric):
    """A metric that raises KeyboardInterrupt on its `stop`-th call and counts calls."""

    def __init__(self, inner: sens.Metric, stop: int | None = None):
        super().__init__(inner.name, inner.label, inner.higher_is_better, inner.fn)
        self.calls, self.stop = 0, stop

    def __call__(self, model):
        self.calls += 1
        if self.stop is not None and self.calls == self.stop:
            raise KeyboardInterrupt
        return super().__call__(model)


def test_resume_skips_finished_layers_and_gives_the_same_ranking(trained, planted, tmp_path):
    _, tok, _ = trained
    fdir, qdir = planted["act"]
    metric = sens.loss_metric(_eval_batches(qdir, tok, 2))
    model = load_model(qdir)[0]
    fw = sens.float_linear_weights(model, load_model(fdir, with_structure=False)[0], list(quant_modules(model)), "f")
    fp = {"qat_ckpt": "abc"}
    full = sens.analyze(model, metric, float_weights=fw)

    state = tmp_path / "analysis.json"
    with pytest.raises(KeyboardInterrupt):  # base + 3 layers finish, the 4th is interrupted
        sens.analyze(model, _Interrupt(metric, stop=5), float_weights=fw, state_path=state, fingerprint=fp)
    saved = json.loads(state.read_text())
    assert not saved["complete"] and len(saved["layers"]) == 3
    counting = _Interrupt(metric)
    res = sens.analyze(model, counting, float_weights=fw, state_path=state, fingerprint=fp)
    assert counting.calls == 8 - 3 and res.resumed == 3  # the base metric is not recomputed either
    assert [(r.name, r.value, r.sensitivity) for r in res.ranked()] == \
           [(r.name, r.value, r.sensitivity) for r in full.ranked()]
    assert json.loads(state.read_text())["complete"]

    with pytest.raises(UsageError, match="differs in: qat_ckpt"):
        sens.analyze(model, metric, float_weights=fw, state_path=state, fingerprint={"qat_ckpt": "other"})
    again = _Interrupt(metric)
    sens.analyze(model, again, float_weights=fw, state_path=state, fingerprint={"qat_ckpt": "other"}, resume=False)
    assert again.calls == 9


def test_cli_end_to_end(run_cli, trained, planted, tmp_path):
    import re

    from gptforge.config import load_config
    from gptforge.transforms.quant import skipped

    _, tok, _ = trained
    fdir, qdir = planted["weight"]
    out = tmp_path / "res"
    argv = ["analyze", "--qat-ckpt", qdir, "--float-ckpt", fdir, "--metric", "loss", "--batches", "3",
            "--top-k", "2", "--out", out, "--no-progress"]
    code, stdout, err = run_cli(*argv)
    assert code == 0, err
    lines = (out / "analysis.txt").read_text().splitlines()
    assert len(lines) == 8
    pat = re.compile(r"^Without quant layer name: (linear_\d+)\.w_0, sensitive metric: (\S+)$")
    parsed = [pat.match(x) for x in lines]
    assert all(parsed) and parsed[0].group(1) == "linear_3"  # blocks.0.linear2
    vals = [float(m.group(2)) for m in parsed]
    assert vals == sorted(vals, reverse=True)
    doc = json.loads((out / "analysis.json").read_text())
    assert doc["complete"] and doc["ranking"][0] | {"value": 0, "sensitivity": 0} == {
        "rank": 1, "name": "blocks.0.linear2", "reference_name": "linear_3", "weight_name": "linear_3.w_0",
        "value": 0, "sensitivity": 0}
    assert doc["float_value"] is not None and doc["base_value"] > doc["float_value"]
    assert (out / "analysis.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "linear_3     blocks.0.linear2" in stdout  # both names side by side
    q = load_config(str(out / "skip_tensor_map.yaml")).Compress.Quantization
    assert skipped("blocks.0.linear2", q) and sum(len(v) for v in q.skip_tensor_map.values()) == 2
    override = re.search(r"-o '(Compress\.Quantization\.skip_tensor_map=[^']+)'", stdout).group(1)
    assert load_config(overrides=[override]).Compress.Quantization.skip_tensor_map == q.skip_tensor_map
    assert f"gptforge qat -c {qdir}/config.yaml -o Compress.pretrained={fdir}" in stdout

    code, stdout, err = run_cli(*argv)  # everything done: resumed, nothing evaluated again
    assert code == 0 and "8 of 8 layers done" in err and "(8 layers resumed)" in stdout
    assert (out / "analysis.txt").read_text().splitlines() == lines

    # ptq mode writes the later Analysis' line format
    code, _, err = run_cli("analyze", "--mode", "ptq", "--float-ckpt", fdir, "--metric", "kl", "--batches", "2",
                           "-o", "Compress.Quantization.calib_batches=2", "--out", tmp_path / "p", "--no-progress",
                           "--no-plot")
    assert code == 0, err
    first = (tmp_path / "p" / "analysis.txt").read_text().splitlines()[0]
    assert re.match(r"^layer name: linear_3\.w_0, sensitivity metric: \S+$", first)
    assert not (tmp_path / "p" / "analysis.png").exists()


def test_cli_lambada_accuracy(run_cli, trained, planted, tmp_path):
    fdir, qdir = planted["act"]
    lam, _ = eval_files(tmp_path)
    code, stdout, err = run_cli("analyze", "--qat-ckpt", qdir, "--float-ckpt", fdir, "--eval-path", lam,
                                "-o", "Offline_Eval.cloze_eval=True", "-o", "Offline_Eval.max_seq_len=32",
                                "--out", tmp_path / "acc", "--no-progress", "--no-plot")
    assert code == 0, err
    doc = json.loads((tmp_path / "acc" / "analysis.json").read_text())
    assert doc["metric"] == "acc" and "LAMBADA accuracy x100" in stdout
    assert doc["float_value"] == 100.0 and doc["base_value"] < 100.0  # the planted outlier costs accuracy
    top = doc["ranking"][0]
    assert top["name"] == PLANTED["act"] and top["sensitivity"] == pytest.approx(top["value"] - doc["base_value"])
    for r in doc["ranking"]:  # accuracy x100 of 12 examples
        assert r["value"] * 12 / 100 == pytest.approx(round(r["value"] * 12 / 100), abs=1e-9)


def test_user_errors(run_cli, trained, planted, tmp_path):
    _, _, ckpt = trained
    fdir, qdir = planted["weight"]
    cases = [
        (["analyze"], "--ckpt"),
        (["analyze", "--qat-ckpt", fdir, "--metric", "loss"], "no fake-quant Linear"),
        (["analyze", "--qat-ckpt", qdir, "--metric", "acc"], "Offline_Eval.eval_path"),
        (["analyze", "--mode", "ptq", "--qat-ckpt", qdir, "--float-ckpt", fdir], "not both"),
        (["analyze", "--qat-ckpt", qdir, "--layers", "blocks.9.linear1"], "--layers"),
        (["analyze", "--qat-ckpt", qdir, "--top-k", "0"], "--top-k"),
    ]
    for argv, needle in cases:
        code, _, err = run_cli(*argv, "--out", tmp_path / "e", "--no-progress")
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (argv, err)
    # a float baseline of another shape
    other = train_config(tmp_path, "Model.ffn_hidden_size=128")
    from gptforge.model import build_model

    save_model_dir(build_model(other.Model), other, tmp_path / "narrow", small_tokenizer())
    code, _, err = run_cli("analyze", "--qat-ckpt", qdir, "--float-ckpt", tmp_path / "narrow", "--metric", "loss",
                           "--batches", "1", "--out", tmp_path / "e2", "--no-progress")
    assert code == 2 and "blocks.0.linear1.weight has shape" in err
    with pytest.raises(CheckpointError):
        sens.analysis_layers(load_model(ckpt)[0])


def test_report_helpers():
    from gptforge.compress.sensitivity_report import flow_map, skip_tensor_map, suggest_k

    m = skip_tensor_map(["blocks.3.linear2", "blocks.0.attn.qkv_proj", "blocks.3.linear1"], {"block_5": ["linear1"]})
    assert m == {"block_0": ["qkv_proj"], "block_3": ["linear1", "linear2"], "block_5": ["linear1"]}
    assert flow_map(m) == "{block_0: [qkv_proj], block_3: [linear1, linear2], block_5: [linear1]}"

    def analysis(values):
        names = [f"blocks.{i}.linear1" for i in range(len(values))]
        layers = {n: sens.LayerResult(n, f"linear_{4 * i + 2}", 0.0, v, 0.0) for i, (n, v) in enumerate(zip(names, values, strict=True))}
        return sens.Analysis("qat", "acc", "", 0.0, layers, names)

    assert suggest_k(analysis([3.0, 1.0, 1.0, 1.0, -2.0])) == 1
    assert suggest_k(analysis([1.0, 1.0, 1.0, 1.0])) == 2
    assert suggest_k(analysis([-1.0, -2.0])) == 0
    assert [r.name for r in analysis([1.0, 5.0, 5.0]).ranked()] == ["blocks.1.linear1", "blocks.2.linear1",
                                                                     "blocks.0.linear1"]


def test_a_state_of_other_inputs_names_the_nested_key_that_differs(tmp_path):
    """An analysis made with another GPTQ head dampening (or any nested setting) is refused with
    the dotted key, not just its section."""
    state = tmp_path / "analysis.json"
    old = {"float_ckpt": "abc", "weights": {"group_size": 64, "damp": 0.01, "head_damp": None}}
    state.write_text(json.dumps({"format": sens.STATE_FORMAT, "fingerprint": old}))
    new = {"float_ckpt": "abc", "weights": {"group_size": 64, "damp": 0.01, "head_damp": 0.5}}
    with pytest.raises(UsageError, match=r"differs in: weights\.head_damp\);"):
        sens.read_state(state, new)
    with pytest.raises(UsageError, match=r"differs in: float_ckpt, weights\.group_size\)"):
        sens.read_state(state, {"float_ckpt": "x", "weights": dict(new["weights"], group_size=32, head_damp=None)})
    assert sens.read_state(state, old)["fingerprint"] == old
