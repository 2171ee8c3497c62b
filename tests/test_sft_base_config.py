"""A tuned model's config keeps its base's pretraining text (what `ptq` calibrates on and `eval`
reads) where the tuning run left Data.<split>.dataset.input_dir at its default."""
from __future__ import annotations

import os

from gptforge.config import load_config
from gptforge.finetune.sft import inherit_text_dirs


def _raw(train: str, eval_: str) -> dict:
    return {"Data": {"Train": {"dataset": {"input_dir": train}}, "Eval": {"dataset": {"input_dir": eval_}}}}


def test_defaults_take_the_base_dirs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config()
    inherit_text_dirs(cfg, _raw("/corpus/mix", "builtin"))
    assert cfg.Data.Train.dataset.input_dir == "/corpus/mix"
    assert cfg.Data.Eval.dataset.input_dir == "builtin"
    assert os.path.abspath(cfg.Data.Test.dataset.input_dir) == str(tmp_path / "data")  # the base names none


def test_a_dir_the_user_set_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides=[f"Data.Train.dataset.input_dir={tmp_path / 'mine'}",
                                 "Data.Eval.dataset.input_dir=builtin"])
    inherit_text_dirs(cfg, _raw("/corpus/mix", "/corpus/mix"))
    assert cfg.Data.Train.dataset.input_dir == str(tmp_path / "mine")
    assert cfg.Data.Eval.dataset.input_dir == "builtin"


def test_a_base_without_data_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config()
    before = cfg.Data.Train.dataset.input_dir
    inherit_text_dirs(cfg, {"Model": {"hidden_size": 8}})
    assert cfg.Data.Train.dataset.input_dir == before
