"""Helpers shared by tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

from gptforge.config import Config, load_config
from gptforge.model import GPT, build_model


def tiny_config(*overrides: str, preset: str = "tiny") -> Config:
    """A resolved config for a tiny model; extra `Section.key=value` overrides apply last."""
    return load_config(overrides=[f"Model.preset={preset}", "Model.hidden_dropout_prob=0",
                                  "Model.attention_probs_dropout_prob=0", *overrides])


def tiny_model(*overrides: str) -> tuple[GPT, Config]:
    cfg = tiny_config(*overrides)
    return build_model(cfg.Model).eval(), cfg
