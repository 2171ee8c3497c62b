"""`Engine.distill`: training with the teacher term brings the student's distribution closer to
the teacher's than the same training without it; bad settings are one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from gptforge.errors import ConfigError
from gptforge.model_io import load_model, save_model_dir
from gptforge.train.distill import check_distill, kl_to_teacher
from test_generate import _spread
from test_train_support import small_tokenizer, train_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _kl(student, teacher, ids) -> float:
    with torch.no_grad():
        s, t = student(ids).logits, teacher(ids).logits
    w = torch.full(ids.shape, 1.0 / ids.numel())
    return float(kl_to_teacher(s, t, w))


def test_distillation_lowers_the_kl_to_the_teacher(tmp_path):
    from gptforge.model import build_model
    from gptforge.train import pretrain

    base = train_config(tmp_path, "Engine.eval_freq=0", "Engine.save_load.save_steps=-1", steps=12)
    teacher = _spread(build_model(base.Model), 7).eval()  # a distribution far from the data's
    save_model_dir(teacher, base, tmp_path / "teacher", tokenizer=small_tokenizer())
    runs = {}
    for name, alpha in (("distilled", 1.0), ("plain", 0.0)):
        distill = () if not alpha else (f"Engine.distill.teacher={tmp_path / 'teacher'}",
                                        f"Engine.distill.alpha={alpha}", "Engine.distill.temperature=2")
        cfg = train_config(tmp_path, "Engine.eval_freq=0", "Engine.save_load.save_steps=-1",
                           f"Engine.save_load.output_dir={tmp_path / name}", *distill, steps=12)
        runs[name] = pretrain(cfg, tokenizer=small_tokenizer(), progress=False, echo=False).checkpoint_dir
    ids = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(base.Global.seed)
    init = build_model(base.Model).eval()
    kl = {name: _kl(load_model(Path(d))[0], teacher, ids) for name, d in runs.items()}
    kl["init"] = _kl(init, teacher, ids)
    assert kl["distilled"] < 0.7 * kl["init"] and kl["distilled"] < 0.7 * kl["plain"], kl


def test_kl_is_zero_for_the_teacher_itself_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 10, generator=g), torch.randn(2, 3, 10, generator=g)
    w = torch.full((2, 3), 1 / 6)
    assert float(kl_to_teacher(a, a, w)) == pytest.approx(0.0, abs=1e-6)
    assert float(kl_to_teacher(a, b, w)) > 0.1


def test_bad_settings_name_the_key(tmp_path):
    cfg = train_config(tmp_path, "Engine.distill.teacher=somewhere")
    for key, value in (("alpha", 1.5), ("temperature", 0.0)):
        bad = dataclasses.replace(cfg.Engine.distill, **{key: value})
        c = dataclasses.replace(cfg, Engine=dataclasses.replace(cfg.Engine, distill=bad))
        with pytest.raises(ConfigError, match=f"Engine.distill.{key}"):
            check_distill(c)
