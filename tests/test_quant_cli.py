"""`gptforge qat / ptq / quantize` end to end on a tiny trained model: training with scales in
the checkpoint, exact resume, eval and generate on QAT, PTQ and INT8 directories, user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gptforge.model_io import load_model
from gptforge.train import pretrain
from gptforge.transforms.int8 import Int8Linear
from gptforge.transforms.quant import QuantLinear
from test_train_support import small_tokenizer, train_config

QAT_OPTS = ("-o", "Engine.logging_freq=1", "-o", "Engine.eval_freq=100", "-o", "Optimizer.lr.max_lr=1e-3",
            "-o", "Compress.Quantization.activation_preprocess_type=PACT",
            "-o", "Compress.Quantization.freeze_embedding=true", "--no-progress")


@pytest.fixture(scope="module")
def float_run(tmp_path_factory):
    """A tiny float model trained for 16 steps; returns (root, step dir)."""
    root = tmp_path_factory.mktemp("quant_cli")
    cfg = train_config(root, "Engine.save_load.save_steps=-1", "Engine.eval_freq=100", steps=16)
    pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    return root, root / "out" / "step_16"


def _losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def _eval(run_cli, ckpt: Path, text: Path, out: Path) -> float:
    code, _, err = run_cli("eval", "--ckpt", ckpt, "-o", f"Offline_Eval.eval_path={text}", "-o",
                           "Offline_Eval.max_seq_len=32", "-o", "Offline_Eval.overlapping_eval=16", "--no-progress",
                           "--output", out)
    assert code == 0, err
    return json.loads(out.read_text())["metrics"]["avg_loss"]


def test_qat_ptq_convert_eval_generate(run_cli, float_run, tmp_path):
    root, float_ckpt = float_run
    out = tmp_path / "qat"
    code, _, err = run_cli("qat", "--ckpt", float_ckpt, "-o", f"Engine.save_load.output_dir={out}",
                           "-o", "Engine.max_steps=6", "-o", "Engine.save_load.save_steps=3", *QAT_OPTS)
    assert code == 0, err
    step = out / "step_6"
    sd = load_file(str(step / "model.safetensors"))
    assert "blocks.0.linear1.act_scale" in sd and "blocks.1.attn.qkv_proj.pact_alpha" in sd
    assert float(sd["blocks.0.linear1.act_scale"]) != pytest.approx(0.001)  # trained, not the initial value
    float_sd = load_file(str(float_ckpt / "model.safetensors"))
    assert torch.equal(sd["wte.weight"], float_sd["wte.weight"])  # freeze_embedding
    assert not torch.equal(sd["blocks.0.linear1.weight"], float_sd["blocks.0.linear1.weight"])
    model, cfg = load_model(step)
    assert cfg.Compress.Quantization.enable and isinstance(model.blocks[0].linear1, QuantLinear)

    # exact resume: 3 steps, then a resumed run to 6, equals the straight 6-step run
    out2 = tmp_path / "qat2"
    code, _, err = run_cli("qat", "--ckpt", float_ckpt, "-o", f"Engine.save_load.output_dir={out2}",
                           "-o", "Engine.max_steps=3", "-o", "Engine.save_load.save_steps=3", *QAT_OPTS)
    assert code == 0, err
    code, _, err = run_cli("qat", "--ckpt", out2, "-o", "Engine.max_steps=6", "--no-progress")
    assert code == 0, err
    assert _losses(out2) == _losses(out)  # the resumed run appends steps 4..6 to the same metrics file
    assert torch.equal(load_file(str(out2 / "step_6" / "model.safetensors"))["blocks.1.linear2.act_accum"],
                       sd["blocks.1.linear2.act_accum"])

    # a fresh run into a directory that holds checkpoints is refused
    code, _, err = run_cli("qat", "--ckpt", float_ckpt, "-o", f"Engine.save_load.output_dir={out}", *QAT_OPTS)
    assert code == 2 and "already holds checkpoints of another run" in err and "\n" not in err.strip()

    code, stdout, err = run_cli("ptq", "--ckpt", float_ckpt, "--out", tmp_path / "ptq", "--calib-batches", "2",
                                "--no-progress")
    assert code == 0, err
    assert isinstance(load_model(tmp_path / "ptq")[0].blocks[0].attn.out_proj, QuantLinear)

    code, stdout, err = run_cli("quantize", "--ckpt", step, "--out", tmp_path / "int8", "--convert")
    assert code == 0, err
    assert "INT8 layers" in stdout and "argmax agreement" in stdout
    report = json.loads((tmp_path / "int8" / "int8_report.json").read_text())
    assert report["check_data"] == "Train batch 0" and report["argmax_agreement"] >= 0.99
    assert isinstance(load_model(tmp_path / "int8")[0].blocks[1].linear2, Int8Linear)

    code, stdout, _ = run_cli("quantize", "--ckpt", tmp_path / "int8")
    assert code == 0 and "linear_7" in stdout and "int8" in stdout

    text = tmp_path / "wiki.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs.\n" * 3)
    losses = {d: _eval(run_cli, tmp_path / d if d != "qat" else step, text, tmp_path / f"{d}.json")
              for d in ("qat", "int8", "ptq")}
    assert losses["int8"] == pytest.approx(losses["qat"], rel=2e-2)

    code, stdout, err = run_cli("generate", "--ckpt", tmp_path / "int8", "--prompt", "the quick", "-o",
                                "Generation.decode_strategy=greedy_search", "-o", "Generation.max_dec_len=6",
                                "--no-stream")
    assert code == 0, err
    assert stdout.startswith("the quick")


def test_user_errors_are_one_line(run_cli, float_run, tmp_path):
    root, float_ckpt = float_run
    cfg = root / "cfg.yaml"
    cfg.write_text("Model:\n  preset: tiny\n")
    code, _, err = run_cli("qat", "-c", cfg, "-o", f"Engine.save_load.output_dir={tmp_path / 'o'}")
    assert code == 2 and "Compress.pretrained" in err
    code, _, err = run_cli("quantize", "--ckpt", float_ckpt, "--convert")
    assert code == 2 and "--out" in err
    code, _, err = run_cli("quantize", "--ckpt", float_ckpt, "--convert", "--out", tmp_path / "x")
    assert code == 2 and "not a fake-quant model" in err
    code, _, err = run_cli("ptq", "--ckpt", float_ckpt, "--out", tmp_path / "p",
                           "-o", "Compress.Quantization.weight_quantize_type=kl")
    assert code == 2 and "Compress.Quantization.weight_quantize_type" in err
    assert len(err.strip().splitlines()) == 1


def test_qat_takes_the_shape_of_a_pruned_pretrained_model(float_run, tmp_path):
    """Compress.pretrained with narrower layers than the run config's Model section (prune -> QAT)."""
    from gptforge.compress.qat import qat
    from gptforge.model import build_model
    from gptforge.model_io import save_model_dir

    root, _ = float_run
    cfg = train_config(root, f"Engine.save_load.output_dir={tmp_path / 'qat'}", "Engine.eval_freq=100",
                       "Engine.save_load.save_steps=-1", steps=2)
    narrow = train_config(root, "Model.layer_num_heads=[3,4]", "Model.layer_ffn_sizes=[96,160]")
    model = build_model(narrow.Model)
    save_model_dir(model, narrow, tmp_path / "pruned", small_tokenizer())
    cfg.Compress.pretrained = str(tmp_path / "pruned")
    res = qat(cfg, progress=False, echo=False)
    q, qcfg = load_model(res.checkpoint_dir)
    assert qcfg.Model.layer_ffn_sizes == [96, 160] and qcfg.Model.layer_num_heads == [3, 4]
    assert isinstance(q.blocks[0].linear1, QuantLinear) and q.blocks[0].linear1.out_features == 96
    assert q.blocks[0].attn.qkv_proj.out_features == 3 * 3 * 16
