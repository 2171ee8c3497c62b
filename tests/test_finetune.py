"""`gptforge finetune`: the reference's recipe keys, the classifier head, epoch/step runs, starting
points (ours, HF, .pdparams, QAT, pruned), `gptforge eval` on a dev file, HF and ONNX exports."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gptforge.config import load_config
from gptforge.errors import ConfigError
from gptforge.finetune import load_classifier
from gptforge.finetune.classifier import SequenceClassifier, last_token_index
from gptforge.finetune.run import finetune
from test_finetune_support import (
    finetune_yaml,
    pair_rows,
    score_rows,
    sentiment_rows,
    small_tokenizer,
    tiny_model_dir,
    write_split,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("base") / "model")


@pytest.fixture(scope="module")
def sst2(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue") / "SST-2"
    write_split(root, "SST2", "train", sentiment_rows(48, 1))
    write_split(root, "SST2", "dev", sentiment_rows(24, 2))
    return root


def _cfg(path, *overrides):
    return load_config(path, list(overrides))


def test_reference_recipe_keys_load(tmp_path, base, sst2):
    cfg = _cfg(finetune_yaml(tmp_path / "f.yaml", "SST2", sst2, base, tmp_path / "out"), "Model.num_classes=2")
    e = cfg.Engine
    assert (e.run_mode, e.max_steps, e.num_train_epochs, e.save_load.save_epoch, e.eval_freq) == ("epoch", -1, 2, 1, 1)
    assert cfg.Model.num_classes == 2 and cfg.Model.module == "GPTFinetuneModule"
    assert cfg.Optimizer.lr.warmup == 0.1 and cfg.Optimizer.lr.warmup_rate == 0.1
    ds = cfg.Data.Train.dataset
    assert (ds.name, ds.root, ds.split, ds.max_length) == ("SST2", str(sst2), "train", 32)
    assert cfg.Data.Train.sampler.batch_size == 8 and cfg.Data.Train.sampler.name == "DistributedBatchSampler"
    assert _cfg(None, "Optimizer.lr.warmup=3").Optimizer.lr.warmup_steps == 3
    with pytest.raises(ConfigError, match="Engine.run_mode: must be step or epoch"):
        _cfg(None, "Engine.run_mode=iters")
    with pytest.raises(ConfigError, match=r"Engine.max_steps: must be >= 0 \(or -1"):
        _cfg(None, "Engine.max_steps=-2")
    # pretraining still needs a step count and split weights
    from gptforge.config import check_train_shapes

    with pytest.raises(ConfigError, match="Engine.max_steps: -1 needs Engine.run_mode=epoch"):
        check_train_shapes(_cfg(None, "Engine.max_steps=-1"))
    with pytest.raises(ConfigError, match="names a fine-tuning split"):
        check_train_shapes(_cfg(None, "Data.Train.dataset.split=train"))


def test_head_pools_the_last_real_token_like_the_reference(base):
    from gptforge.model_io import load_model

    torch.manual_seed(0)
    gpt, _ = load_model(base)
    clf = SequenceClassifier(gpt, 3, pad_token_id=383).eval()
    assert clf.score.bias is None and clf.score.weight.shape == (3, 32)
    assert clf.score.weight.std().item() == pytest.approx(0.02, rel=0.35)  # N(0, initializer_range)
    seqs = [[5, 6, 7, 8, 9], [10, 11], [12, 0, 13]]  # id 0 inside a text is a real token here
    ids = torch.full((3, 5), 383)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    assert last_token_index(ids, 383).tolist() == [4, 1, 2]
    with torch.no_grad():
        batched = clf(ids)
        alone = torch.cat([clf(torch.tensor([s])) for s in seqs])
        h = gpt.hidden_states(torch.tensor([seqs[1]]))[0, -1]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)  # right padding never leaks back
    torch.testing.assert_close(batched[1], clf.score.weight @ h, atol=1e-5, rtol=1e-5)
    # the reference's rule: pad 0, position = count(ids != 0) - 1 (same token when 0 only pads)
    ref_ids = torch.where(ids == 383, torch.zeros_like(ids), ids)[:2]
    assert ((ref_ids != 0).sum(-1) - 1).tolist() == last_token_index(ref_ids, 0).tolist()


def test_epoch_run_cli_saves_evaluates_and_follows_the_schedule(tmp_path, base, sst2, run_cli, monkeypatch):
    y = finetune_yaml(tmp_path / "f.yaml", "SST2", sst2, base, tmp_path / "out")
    code, out, err = run_cli("finetune", "-c", y, "-o", "Engine.num_train_epochs=3", "-o",
                             "Engine.save_load.save_epoch=2", "-o", "Engine.eval_freq=2", "--no-progress")
    assert code == 0, err
    out_dir = tmp_path / "out"
    assert sorted(p.name for p in out_dir.glob("epoch_*")) == ["epoch_2", "epoch_3"]  # every 2nd + the last
    res = json.loads((out_dir / "finetune_results.json").read_text())
    assert res["steps"] == 3 * (48 // 8) and res["metric"] == "Accuracy"
    assert [e["epoch"] for e in res["evals"]] == [2, 3]
    assert res["evals"][-1]["dev"]["acc"] >= 0.9, res["evals"]  # the adjective decides the label
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if r["kind"] == "train"]
    total, warm = 18, 0.1 * 18  # LinearDecayWithWarmup, warmup 0.1 of the total steps
    expect = [1e-2 * k / warm if k <= warm else 1e-2 * (total - k) / (total - warm) for k in range(total)]
    assert lrs == pytest.approx(expect)
    assert "best (epoch" in out and "[Eval] epoch: 2" in (out_dir / "train.log").read_text()

    # gptforge eval on the dev file: the task metric, equal to the run's last evaluation
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("eval", "--ckpt", out_dir / "epoch_3")
    assert code == 0, err
    got = json.loads((tmp_path / "eval_results_glue.json").read_text())  # the working directory, not the model
    assert got["task"] == "SST2" and got["results"]["dev"]["acc"] == res["evals"][-1]["dev"]["acc"]
    assert got["results"]["dev"]["loss"] == pytest.approx(res["evals"][-1]["dev"]["loss"], rel=1e-5)
    code, out, err = run_cli("eval", "--ckpt", out_dir / "epoch_3", "--glue-file", sst2 / "train.tsv",
                             "--output", tmp_path / "r.json")
    assert code == 0 and "SST2 train.tsv: acc:" in out
    assert json.loads((tmp_path / "r.json").read_text())["results"]["train.tsv"]["examples"] == 48


def test_step_mode_mnli_matched_and_mismatched(tmp_path, base):
    root = tmp_path / "MNLI"
    write_split(root, "MNLI", "train", pair_rows(40, 3, classes=3))
    write_split(root, "MNLI", "dev_matched", pair_rows(12, 4, classes=3))
    write_split(root, "MNLI", "dev_mismatched", pair_rows(10, 5, classes=3))
    cfg = _cfg(finetune_yaml(tmp_path / "f.yaml", "MNLI", root, base, tmp_path / "out"), "Engine.run_mode=step",
               "Engine.max_steps=7", "Engine.eval_freq=5", "Engine.save_load.save_steps=5")
    r = finetune(cfg, echo=False, progress=False)
    assert r.steps == 7 and len(r.losses) == 7 and r.epochs == 2  # 5 steps per epoch
    assert [e["step"] for e in r.evals] == [5, 7]
    assert {"dev_matched", "dev_mismatched"} <= set(r.evals[0])
    assert r.evals[0]["dev_matched"]["examples"] == 12 and r.evals[0]["dev_mismatched"]["examples"] == 10
    assert sorted(p.name for p in (tmp_path / "out").glob("step_*")) == ["step_5", "step_7"]
    clf, _, _, task = load_classifier(tmp_path / "out" / "step_7")
    assert task == "MNLI" and clf.num_classes == 3


def test_stsb_regression_with_mse(tmp_path, base):
    root = tmp_path / "STS-B"
    write_split(root, "STSB", "train", score_rows(32, 6))
    write_split(root, "STSB", "dev", score_rows(16, 7))
    y = finetune_yaml(tmp_path / "f.yaml", "STSB", root, base, tmp_path / "out")
    with pytest.raises(ConfigError, match="CrossEntropyLoss does not fit STSB"):
        finetune(_cfg(y), echo=False)
    cfg = _cfg(y, "Model.loss.train.name=MSELoss", "Model.metric.eval.name=PearsonAndSpearman",
               "Engine.num_train_epochs=1", "Model.num_classes=1")
    r = finetune(cfg, echo=False, progress=False)
    dev = r.evals[-1]["dev"]
    assert set(dev) >= {"pearson", "spearman", "corr", "loss"} and math.isfinite(dev["pearson"])
    clf, *_ = load_classifier(tmp_path / "out" / "epoch_1")
    assert clf.num_classes == 1


def test_user_errors_are_one_line(tmp_path, base, sst2, run_cli):
    y = finetune_yaml(tmp_path / "f.yaml", "SST2", sst2, base, tmp_path / "out")
    cases = [
        (["-o", "Data.Train.dataset.name=GPTDataset"], "Data.Train.dataset.name: 'GPTDataset' is not a GLUE task"),
        (["-o", "Model.num_classes=1"], "Model.num_classes: SST2 has 2 labels, got 1"),
        (["-o", "Model.pretrained="], "Model.pretrained: set the model to fine-tune"),
        (["-o", f"Data.Train.dataset.root={tmp_path / 'none'}"], "SST2 directory not found"),
        (["-o", "Data.Train.dataset.max_length=100"], "Data.Train.dataset.max_length: 100 exceeds the model's 64"),
        (["-o", "Data.Train.sampler.batch_size=100"], "make no batch of 100"),
        (["-o", "Model.metric.eval.name=Mcc2"], "Model.metric.eval.name: 'Mcc2' is not one of"),
        (["-o", "Engine.save_load.ckpt_dir=x"], "x: resume checkpoint not found"),
        (["-o", "Data.Train.dataset.root="], "Data.Train.dataset.root: not set; give the SST2 directory"),
    ]
    for extra, msg in cases:
        code, out, err = run_cli("finetune", "-c", y, *extra, "--no-progress")
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, (extra, err)


def _tiny_run(tmp_path, start, sst2, *extra):
    tmp_path.mkdir(parents=True, exist_ok=True)
    y = finetune_yaml(tmp_path / "f.yaml", "SST2", sst2, start, tmp_path / "out")
    return finetune(_cfg(y, "Engine.max_steps=2", "Engine.num_train_epochs=1", *extra), echo=False, progress=False)


def test_starts_from_hf_and_pdparams(tmp_path, base, sst2):
    from gptforge.export.hf import save_hf
    from gptforge.model_io import load_model
    from test_convert_paddle import write_pdparams

    gpt, cfg = load_model(base)
    save_hf(gpt, tmp_path / "hf", small_tokenizer(), model_cfg=cfg.Model)
    r = _tiny_run(tmp_path / "a", tmp_path / "hf", sst2)
    assert r.steps == 2 and r.checkpoint_dir.name == "epoch_1"
    # a reference .pdparams (the recipe's `pretrained: .../model` prefix), vocab from the tokenizer dir
    sd = {k: v.numpy() for k, v in gpt.state_dict().items()}
    hd = 8
    arrays = {"gpt.embeddings.word_embeddings.weight": sd["wte.weight"],
              "gpt.embeddings.position_embeddings.weight": sd["wpe.weight"],
              "gpt.decoder.norm.weight": sd["norm.weight"], "gpt.decoder.norm.bias": sd["norm.bias"]}
    for i in range(2):
        p, q = f"gpt.decoder.layers.{i}.", f"blocks.{i}."
        arrays.update({p + "self_attn.qkv_proj.weight": sd[q + "attn.qkv_proj.weight"].T,
                       p + "self_attn.qkv_proj.bias": sd[q + "attn.qkv_proj.bias"],
                       p + "self_attn.out_proj.weight": sd[q + "attn.out_proj.weight"].T,
                       p + "self_attn.out_proj.bias": sd[q + "attn.out_proj.bias"],
                       p + "linear1.weight": sd[q + "linear1.weight"].T, p + "linear1.bias": sd[q + "linear1.bias"],
                       p + "linear2.weight": sd[q + "linear2.weight"].T, p + "linear2.bias": sd[q + "linear2.bias"]})
        for n in ("norm1", "norm2"):
            arrays[p + f"{n}.weight"], arrays[p + f"{n}.bias"] = sd[q + f"{n}.weight"], sd[q + f"{n}.bias"]
    assert hd * 4 == 32
    (tmp_path / "pd").mkdir()
    write_pdparams(tmp_path / "pd" / "model.pdparams", arrays)
    small_tokenizer().save(tmp_path / "tok")
    r2 = _tiny_run(tmp_path / "b", tmp_path / "pd" / "model", sst2, "Model.num_attention_heads=4",
                   f"Data.tokenizer={tmp_path / 'tok'}")
    assert r2.steps == 2
    # all three start from the same weights: the first step's loss is the same
    r3 = _tiny_run(tmp_path / "c", base, sst2)
    assert r.losses[0] == pytest.approx(r3.losses[0], rel=1e-4) and r2.losses[0] == pytest.approx(r3.losses[0], rel=1e-4)


def test_fine_tunes_qat_and_pruned_models(tmp_path, base, sst2):
    from gptforge.model_io import load_model, save_model_dir
    from gptforge.transforms.prune import prune_model, record_shape
    from gptforge.transforms.quant import QuantLinear, quantize_model

    gpt, cfg = load_model(base)
    cfg.Compress.Quantization.enable = True
    quantize_model(gpt, cfg.Compress.Quantization)
    save_model_dir(gpt, cfg, tmp_path / "qat", small_tokenizer())
    r = _tiny_run(tmp_path / "q", tmp_path / "qat", sst2)
    clf, ccfg, _, _ = load_classifier(r.checkpoint_dir)
    assert ccfg.Compress.Quantization.enable and any(isinstance(m, QuantLinear) for m in clf.gpt.modules())

    gpt, cfg = load_model(base)
    cfg.Compress.Prune.ratio = 0.5
    prune_model(gpt, cfg.Compress.Prune)
    record_shape(cfg.Model, gpt)
    save_model_dir(gpt, cfg, tmp_path / "pruned", small_tokenizer())
    r = _tiny_run(tmp_path / "p", tmp_path / "pruned", sst2)
    clf, *_ = load_classifier(r.checkpoint_dir)
    shape = [(b.attn.qkv_proj.out_features, b.linear1.out_features) for b in gpt.blocks]
    assert [(b.attn.qkv_proj.out_features, b.linear1.out_features) for b in clf.gpt.blocks] == shape
    assert all(q <= 96 and f <= 64 for q, f in shape) and shape != [(96, 64)] * 2  # narrower than the base


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base, sst2):
    d = tmp_path_factory.mktemp("trained")
    y = finetune_yaml(d / "f.yaml", "SST2", sst2, base, d / "out")
    return finetune(_cfg(y, "Engine.num_train_epochs=1"), echo=False, progress=False).checkpoint_dir


def _padded_batch(tok, texts):
    ids = [tok.encode(t) for t in texts]
    x = torch.full((len(ids), max(map(len, ids))), tok.eos_token_id)
    for i, s in enumerate(ids):
        x[i, :len(s)] = torch.tensor(s)
    return x


def test_hf_export_equal_logits_in_transformers(tmp_path, trained, run_cli):
    transformers = pytest.importorskip("transformers")
    code, out, err = run_cli("export", "--format", "hf", "--ckpt", trained, "--out", tmp_path / "hf")
    assert code == 0, err
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["architectures"] == ["GPT2ForSequenceClassification"] and conf["num_labels"] == 2
    clf, _, tok, _ = load_classifier(trained)
    assert conf["pad_token_id"] == tok.eos_token_id == clf.pad_token_id
    hf = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    x = _padded_batch(tok, ["the film was good and long", "bad", "the show was dull and old", "the book was sweet"])
    with torch.no_grad():
        ours, theirs = clf(x), hf(input_ids=x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert (x == tok.eos_token_id).any()  # the batch really is padded


@pytest.mark.slow  # the dynamo ONNX export takes ~25 s on a busy 2-core machine
def test_onnx_export_equal_logits(tmp_path, trained, run_cli):
    ort = pytest.importorskip("onnxruntime")
    code, out, err = run_cli("export", "--format", "onnx", "--ckpt", trained, "--out", tmp_path / "onnx")
    assert code == 0, err
    assert "onnx classifier fp32" in out and "max |logit diff|" in out
    meta = json.loads((tmp_path / "onnx" / "gptforge_export.json").read_text())
    assert meta["kind"] == "classifier" and meta["outputs"] == ["logits"]
    clf, _, tok, _ = load_classifier(trained)
    sess = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    for texts in (["the film was good and long", "bad"], ["the show was dull and old", "the book was sweet", "x"]):
        x = _padded_batch(tok, texts)
        with torch.no_grad():
            ours = clf(x).numpy()
        got = sess.run(["logits"], {"input_ids": x.numpy()})[0]
        np.testing.assert_allclose(got, ours, atol=1e-4)
    code, out, err = run_cli("export", "--format", "torch", "--ckpt", trained, "--out", tmp_path / "t")
    assert code == 2 and "export a classifier with --format hf or onnx" in err


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mixed_precision_runs(tmp_path, base, sst2, dtype):
    r = _tiny_run(tmp_path, base, sst2, "Engine.mix_precision.enable=True", f"Engine.mix_precision.dtype={dtype}")
    assert r.steps == 2 and all(math.isfinite(x) for x in r.losses)
    assert math.isfinite(r.evals[-1]["dev"]["loss"])
    clf, *_ = load_classifier(r.checkpoint_dir)
    assert clf.score.weight.dtype == torch.float32  # master weights stay fp32
