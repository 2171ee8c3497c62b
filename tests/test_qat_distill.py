"""`Compress.Quantization.distill`: QAT trained toward the float model it starts from. The loss of
a step is KL(teacher || student) as `torch.nn.functional.kl_div` computes it on the float model's
and the fake-quant model's logits (mixed with the cross-entropy by `Engine.distill.alpha`); a
few steps bring the fake-quant model closer to the float model than the LM loss does; the teacher
recorded by a fresh run is the one a resume loads; user errors name the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from gptforge.compress.qat import qat
from gptforge.config.schema import QuantizationConfig
from gptforge.model_io import load_model
from gptforge.train.distill import Distiller
from gptforge.transforms.quant import quantize_model
from test_train_support import small_tokenizer, train_config

pytestmark = pytest.mark.usefixtures("one_thread")

INT4 = ("Compress.Quantization.weight_only=true", "Compress.Quantization.weight_bits=4",
        "Compress.Quantization.group_size=32", "Compress.Quantization.head_bits=4")


@pytest.fixture(scope="module")
def float_run(tmp_path_factory):
    """A tiny float model trained for 8 steps: (its run directory, its step_8)."""
    from gptforge.train import pretrain

    root = tmp_path_factory.mktemp("qat_distill")
    cfg = train_config(root, "Engine.save_load.save_steps=-1", "Engine.eval_freq=100", steps=8)
    pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)
    return root / "out", root / "out" / "step_8"


def _run(tmp_path: Path, src: Path, out: str, *keys: str, steps: int = 2, lr: float = 1e-3):
    cfg = train_config(tmp_path, "Engine.eval_freq=100", f"Engine.save_load.save_steps={steps}",
                       f"Engine.save_load.output_dir={tmp_path / out}", f"Compress.pretrained={src}",
                       f"Optimizer.lr.max_lr={lr}", f"Optimizer.lr.min_lr={lr / 10}", "Optimizer.lr.warmup_rate=0", *keys,
                       steps=steps)
    return qat(cfg, tokenizer=small_tokenizer(), progress=False, echo=False)


def _kd_reference(student, teacher, batch, alpha: float, temperature: float) -> torch.Tensor:
    """The loss written from the definition with torch's own KL (not gptforge's)."""
    s = student(batch["tokens"], position_ids=batch["position_ids"]).logits.float()
    t = teacher(batch["tokens"], position_ids=batch["position_ids"]).logits.float()
    kl = F.kl_div(F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1), log_target=True,
                  reduction="none").sum(-1)
    mask = (batch["labels"] != -100).float() * batch["loss_mask"].float()
    ce = F.cross_entropy(s.flatten(0, 1), batch["labels"].flatten(), reduction="none").view_as(mask)
    kd = (kl * mask).sum() / mask.sum()
    return (1 - alpha) * (ce * mask).sum() / mask.sum() + alpha * temperature ** 2 * kd


@pytest.mark.parametrize("alpha,temperature", [(1.0, 1.0), (0.5, 2.0)])
def test_first_step_loss_is_the_kl_to_the_starting_float_model(float_run, tmp_path, monkeypatch, alpha,
                                                               temperature):
    seen = []
    real = Distiller.loss

    def spy(self, ce, logits, batch):
        seen.append({k: v.clone() for k, v in batch.items()})
        return real(self, ce, logits, batch)

    monkeypatch.setattr(Distiller, "loss", spy)
    res = _run(tmp_path, float_run[1], "kd", *INT4, "Compress.Quantization.distill=true",
               f"Engine.distill.alpha={alpha}", f"Engine.distill.temperature={temperature}", steps=1)
    assert len(seen) == 2  # two micro-batches of the one step
    teacher = load_model(float_run[1])[0].eval()
    q = QuantizationConfig(enable=True, weight_only=True, weight_bits=4, group_size=32, head_bits=4)
    student = quantize_model(load_model(float_run[1])[0], q)  # the step's weights: the float ones
    with torch.no_grad():
        want = sum(float(_kd_reference(student, teacher, b, alpha, temperature)) for b in seen) / len(seen)
    assert res.losses[0] == pytest.approx(want, rel=1e-5, abs=1e-6)


def _kl(student, teacher, ids) -> float:
    with torch.no_grad():
        s, t = student.eval()(ids).logits, teacher(ids).logits
    return float(F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean")
                 / ids.shape[1])


@pytest.mark.parametrize("keys", [INT4, ()], ids=["int4-weight-only", "int8-reference"])
def test_distillation_brings_the_fake_quant_model_toward_the_float_model(float_run, tmp_path, keys):
    teacher = load_model(float_run[1])[0].eval()
    corpus = np.load(float_run[0].parent / "data" / "corpus_ids.npy")  # text like the training data's
    ids = torch.tensor(corpus[-4 * 32:].astype(np.int64)).reshape(4, 32)
    kl = {}
    for name, extra in (("plain", ()), ("distilled", ("Compress.Quantization.distill=true", "Engine.distill.alpha=1"))):
        res = _run(tmp_path, float_run[1], name, *keys, *extra, steps=12, lr=1e-4)
        kl[name] = _kl(load_model(res.checkpoint_dir)[0], teacher, ids)
    assert kl["distilled"] < 0.7 * kl["plain"], kl
    if keys:  # weight-only fake quant needs no calibration: the untrained QAT model is the float one rounded
        cfg = load_model(res.checkpoint_dir)[1]
        kl["start"] = _kl(quantize_model(load_model(float_run[1])[0], cfg.Compress.Quantization), teacher, ids)
        assert kl["distilled"] < 0.7 * kl["start"], kl


def _losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def test_resume_loads_the_recorded_teacher_and_continues_identically(float_run, tmp_path, run_cli):
    run_root, step8 = float_run
    keys = (*INT4, "Compress.Quantization.distill=true", "Engine.distill.alpha=0.7", "Optimizer.lr.decay_steps=4")
    _run(tmp_path, run_root, "straight", *keys, steps=4, lr=2e-3)
    split = tmp_path / "split"
    _run(tmp_path, run_root, "split", *keys, steps=2, lr=2e-3)  # Compress.pretrained: the run directory
    cfg = load_model(split / "step_2")[1]
    assert cfg.Engine.distill.teacher == str(step8.resolve())  # its newest step, recorded
    # The float run grows a newer step with other weights: the resume keeps the recorded teacher.
    newer = run_root / "step_9"
    shutil.copytree(step8, newer)
    sd = load_file(str(newer / "model.safetensors"))
    save_file({k: v * 0.5 for k, v in sd.items()}, str(newer / "model.safetensors"))
    try:
        code, _, err = run_cli("qat", "--ckpt", split / "step_2", "-o", "Engine.max_steps=4",
                               "-o", "Engine.save_load.save_steps=4", "--no-progress")
    finally:
        shutil.rmtree(newer)
    assert code == 0, err
    assert _losses(split) == _losses(tmp_path / "straight")
    a, b = (load_file(str(d / "step_4" / "model.safetensors")) for d in (split, tmp_path / "straight"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_user_errors_name_the_key(float_run, tmp_path, run_cli):
    _, step8 = float_run
    base = ("qat", "--ckpt", step8, "-o", "Engine.max_steps=2", "--no-progress",
            *[a for k in (*INT4, "Compress.Quantization.distill=true") for a in ("-o", k)])
    other = tmp_path / "other"
    shutil.copytree(step8, other)
    for extra, needle in ((("-o", f"Engine.distill.teacher={other}"), "Engine.distill.teacher"),
                          (("-o", "Engine.distill.alpha=1.5"), "Engine.distill.alpha: must be in [0, 1]"),
                          (("-o", "Compress.Quantization.distill=maybe"), "Compress.Quantization.distill")):
        code, _, err = run_cli(*base, "-o", f"Engine.save_load.output_dir={tmp_path / 'e'}", *extra)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (extra, err)
    # the same teacher named twice is fine; resuming a run trained without distillation with it is not
    code, _, err = run_cli(*base, "-o", f"Engine.save_load.output_dir={tmp_path / 'ok'}",
                           "-o", f"Engine.distill.teacher={step8}")
    assert code == 0, err
    plain = tmp_path / "plain"
    code, _, err = run_cli("qat", "--ckpt", step8, "-o", "Engine.max_steps=2", "-o", "Engine.save_load.save_steps=2",
                           "-o", f"Engine.save_load.output_dir={plain}", "--no-progress",
                           *[a for k in INT4 for a in ("-o", k)])
    assert code == 0, err
    code, _, err = run_cli("qat", "--ckpt", plain, "-o", "Engine.max_steps=4", "-o",
                           "Compress.Quantization.distill=true", "--no-progress")
    assert code == 2 and "Compress.Quantization.distill: the checkpoint being resumed" in err, err
