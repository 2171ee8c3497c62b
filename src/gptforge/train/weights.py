"""Weights into a model before training: a resumed checkpoint's shape check and
`Compress.pretrained`."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from gptforge.config.schema import Config
from gptforge.errors import ConfigError


def check_same_shape(want, have, ckpt_dir: Path) -> None:
    """A resumed run keeps its checkpoint's shape: refuse a config (e.g. `-o Model.hidden_size`)
    that asks for another one instead of ignoring it silently."""
    from gptforge.config import ARCH_KEYS

    def norm(v):
        return None if v in ([], (), None) else (list(v) if isinstance(v, (list, tuple)) else v)

    for k in ARCH_KEYS:
        if norm(getattr(want, k)) != norm(getattr(have, k)):
            raise ConfigError(f"Model.{k}: {getattr(want, k)} differs from the resumed checkpoint {ckpt_dir} "
                              f"({getattr(have, k)}); a resumed run keeps its shape: drop the override, or start a "
                              "new run in another output directory")


def load_pretrained(model: nn.Module, path: str | Path, cfg: Config) -> None:
    """Copy `Compress.pretrained` float weights (any format `model_io` reads) into `model` in place.

    Weights only: no optimizer state or step. Tensors the model has but the checkpoint lacks
    are allowed only if they are not weights of the plain GPT (e.g. fake-quant state).
    """
    from gptforge.errors import CheckpointError
    from gptforge.model_io import load_model

    src, _ = load_model(path, cfg, with_structure=False)
    sd = src.state_dict()
    own = model.state_dict()
    for k, v in sd.items():
        if k not in own:
            raise CheckpointError(f"Compress.pretrained: {path} has tensor {k} that the model lacks")
        if tuple(own[k].shape) != tuple(v.shape):
            raise CheckpointError(f"Compress.pretrained: {path} tensor {k} has shape {tuple(v.shape)}, the model "
                                  f"{tuple(own[k].shape)}; the Model section does not describe this checkpoint")
    model.load_state_dict(sd, strict=False)
