"""Quantization-aware training with the normal trainer (spec §8.2).

Order, as in the reference: build the model with the pretrained checkpoint's shape → load the
`Compress.pretrained` float weights → insert fake-quant modules (`quantize_model`) → device →
resumed weights → precision → AdamW over the trainable parameters (PACT alpha in its own
group with `lr_mult = pact_lr_mult`; frozen embeddings left out). Checkpoints are ordinary
training checkpoints whose config carries `Compress.Quantization.enable: true`, so
`load_model` rebuilds the fake-quant model and `gptforge eval --ckpt` evaluates it.

`Compress.Quantization.distill`: the loss is `Engine.distill`'s (KL to a frozen teacher, mixed
with the cross-entropy by its alpha) and the teacher is the model the run starts from
(`distill_from_start`), the standard remedy when fine-tuning an under-trained model with the
LM loss moves it more than the rounding does (LLM-QAT, EfficientQAT).
"""

from __future__ import annotations

import sys
from pathlib import Path

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
    if q.distill:
        distill_from_start(cfg, None if start.resume is not None else source)
        d = cfg.Engine.distill
        _notice(f"distilling from {d.teacher} (Engine.distill.alpha {d.alpha:g}, temperature {d.temperature:g})", echo)
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


def distill_from_start(cfg: Config, start_weights: Path | None) -> None:
    """`Compress.Quantization.distill`: `Engine.distill.teacher` becomes the model the run starts
    from, `start_weights` (`Compress.pretrained` resolved: a run directory's newest step), as an
    absolute path. The saved config records it, so a resumed run (`start_weights` None) loads
    the same teacher even if `Compress.pretrained` names a run directory that has grown since."""
    from gptforge.model_io import resolve_checkpoint_path
    from gptforge.train.distill import check_distill

    d = cfg.Engine.distill
    key = "Compress.Quantization.distill"
    if start_weights is None:
        if not d.teacher:
            raise ConfigError(f"{key}: the checkpoint being resumed was trained without distillation (its "
                              f"Engine.distill.teacher is unset); resume it with {key}=false, or start a new run")
        check_distill(cfg)
        return
    teacher = Path(start_weights).resolve()
    if d.teacher and resolve_checkpoint_path(d.teacher).resolve() != teacher:
        raise ConfigError(f"Engine.distill.teacher: {d.teacher} is not the model the run starts from ({teacher}); "
                          f"with {key} the teacher is Compress.pretrained: leave Engine.distill.teacher unset")
    d.teacher = str(teacher)
    check_distill(cfg)  # alpha, temperature, parallelism: one line before any work
