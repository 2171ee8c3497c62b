"""Quantization-aware training with the normal trainer (spec §8.2).

Order, as in the reference: build the model with the pretrained checkpoint's shape → load the
`Compress.pretrained` float weights → insert fake-quant modules (`quantize_model`) → device →
resumed weights → precision → AdamW over the trainable parameters (PACT alpha in its own
group with `lr_mult = pact_lr_mult`; frozen embeddings left out). Checkpoints are ordinary
training checkpoints whose config carries `Compress.Quantization.enable: true`, so
`load_model` rebuilds the fake-quant model and `gptforge eval --ckpt` evaluates it.
"""

from __future__ import annotations

import sys

from torch import nn

from gptforge.config.schema import Config
from gptforge.errors import ConfigError
from gptforge.transforms.quant import quantize_model, validate_config


def _notice(msg: str, echo: bool = True) -> None:
    if echo:
        print(f"gptforge: {msg}", file=sys.stderr)


def qat(cfg: Config, tokenizer=None, *, resume=None, progress: bool | None = None, echo: bool = True,
        overrides=(), force: bool = False, start=None):
    """Train `cfg` with fake quantization; returns the trainer's `TrainResult`.

    `resume`: a step checkpoint, a run directory or "auto" (as `pretrain`). A fresh run needs
    `Compress.pretrained` (a float model of any format `load_model` reads; a pruned one gives
    its own shape). `overrides` (the `-o` strings) are checked against a resumed checkpoint's
    shape: a shape override is refused rather than ignored. `force`: start over in an output
    directory holding another run's checkpoints. `start`: a `run_start.RunStart` already decided
    (replaces `resume`, `force` and `overrides`).
    """
    from gptforge.config import ARCH_KEYS
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.model_io import checkpoint_model_config, read_checkpoint_config, resolve_checkpoint_path
    from gptforge.train import pretrain
    from gptforge.train.run_start import plan_start

    q = cfg.Compress.Quantization
    q.enable, q.converted = True, False
    if start is None:
        start = plan_start(cfg, resume=resume, force=force, overrides=overrides, echo=echo)
    source = start.resume
    if source is None:
        if not cfg.Compress.pretrained:
            raise ConfigError("Compress.pretrained: not set; QAT starts from a trained float model: "
                              "-o Compress.pretrained=DIR (or --ckpt DIR)")
        source = resolve_checkpoint_path(cfg.Compress.pretrained)
        raw_q = ((read_checkpoint_config(source).get("Compress") or {}).get("Quantization") or {})
        if raw_q.get("converted"):
            _notice(f"Compress.pretrained {source} is an INT8 model: starting from its dequantized weights", echo)
        elif raw_q.get("enable"):
            _notice(f"Compress.pretrained {source} is a fake-quant model: its float weights are used and the "
                    "activation scales start afresh", echo)
    shape = checkpoint_model_config(source, fallback=cfg.Model)
    for k in ARCH_KEYS:
        setattr(cfg.Model, k, getattr(shape, k))
    validate_config(q, cfg.Model.num_layers)
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.Data.tokenizer, source if source.is_dir() else None)

    def transform(model: nn.Module) -> nn.Module:
        return quantize_model(model, q)

    return pretrain(cfg, tokenizer=tokenizer, transform=transform, start=start, progress=progress, echo=echo,
                    verb="qat")
