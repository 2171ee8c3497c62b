"""Post-training quantization: fake-quant modules + activation scales calibrated on a few
batches of the run's data, no training (the baseline QAT has to beat).

Observers (`Compress.Quantization.calib_algo`) see the float activations of every quantized
Linear's input (after the PACT clip when PACT is configured):
- `avg`: the mean over batches of each batch's max|x| (Paddle's PTQ `avg`);
- `abs_max`: the largest max|x| of any batch;
- `moving_average`: the QAT update (rate `moving_rate`, starting from accum = state = 1).
The result is stored exactly where QAT keeps it (`act_scale`; `act_accum`/`act_state` so a
later QAT run continues from it), so a PTQ directory loads, evaluates and converts like a QAT
checkpoint. Weight scales need no calibration (abs-max of the weights).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gptforge.config.schema import Config
from gptforge.errors import ConfigError
from gptforge.transforms.quant import (
    finish_observers,
    quant_modules,
    quantize_model,
    refuse_weight_only,
    start_observers,
    validate_config,
)


def _notice(msg: str, echo: bool = True) -> None:
    if echo:
        print(f"gptforge: {msg}", file=sys.stderr)


def calibration_batches(cfg: Config, tokenizer, n: int) -> list[dict[str, torch.Tensor]]:
    """The first `n` micro-batches of the Train split (what a training run's first steps see)."""
    from gptforge.data.dataset import build_datasets, collate

    mbs = cfg.Global.micro_batch_size or 1
    ds = build_datasets(cfg, ("Train",), num_samples={"Train": n * mbs}, tokenizer=tokenizer)["Train"]
    if len(ds) < n * mbs:
        raise ConfigError(f"Compress.Quantization.calib_batches: {n} batches of {mbs} need {n * mbs} samples, "
                          f"the Train split has {len(ds)}; lower calib_batches or Global.micro_batch_size")
    return [collate([ds[k * mbs + j] for j in range(mbs)]) for k in range(n)]


@torch.no_grad()
def calibrate(model: nn.Module, batches, algo: str = "avg", progress: bool = False) -> dict[str, float]:
    """Run `batches` (dicts with `tokens`, or id tensors) through a fake-quant model in eval mode
    with observers on; store and return the activation scales {layer: scale}."""
    if not quant_modules(model):
        raise ConfigError("Compress.Quantization.enable: the model has no fake-quant layers to calibrate")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    start_observers(model, algo)
    try:
        it = batches
        if progress:
            from gptforge.progress import bar as progress_bar

            it = progress_bar(batches, desc="calibrate", unit="batch")
        for b in it:
            ids = b["tokens"] if isinstance(b, dict) else b
            pos = b.get("position_ids") if isinstance(b, dict) else None
            model(ids.to(device), position_ids=pos.to(device) if pos is not None else None)
    except BaseException:
        for mod in quant_modules(model).values():
            mod.observer = None
        raise
    finally:
        model.train(was_training)
    return finish_observers(model)


@dataclass
class PTQResult:
    out_dir: Path
    scales: dict[str, float]
    source: Path


def ptq(cfg: Config, out_dir: str | os.PathLike, *, source: str | os.PathLike | None = None, tokenizer=None,
        overwrite: bool = False, progress: bool = True, echo: bool = True) -> PTQResult:
    """Quantize the float model at `source` (default `Compress.pretrained`) as
    `Compress.Quantization` says, calibrate on `calib_batches` Train batches, save to `out_dir`."""
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.device import select_device
    from gptforge.model_io import load_model, resolve_checkpoint_path, save_model_dir

    src = source or cfg.Compress.pretrained
    if not src:
        raise ConfigError("Compress.pretrained: not set; PTQ quantizes a trained float model: "
                          "-o Compress.pretrained=DIR (or --ckpt DIR)")
    src = resolve_checkpoint_path(src)
    q = dataclasses.replace(cfg.Compress.Quantization, enable=True, converted=False)
    device = select_device(cfg.Global.device)
    model, cfg = load_model(src, cfg, device=device, with_structure=False)
    validate_config(q, len(model.blocks))  # cfg.Model now has the checkpoint's shape (pruned ones too)
    refuse_weight_only(q, "PTQ")
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.Data.tokenizer, src if src.is_dir() else None)
    quantize_model(model, q)
    batches = calibration_batches(cfg, tokenizer, q.calib_batches)
    scales = calibrate(model, batches, q.calib_algo, progress=progress)
    out_cfg = dataclasses.replace(cfg, Compress=dataclasses.replace(cfg.Compress, Quantization=q, pretrained=str(src)))
    out = save_model_dir(model, out_cfg, out_dir, tokenizer, overwrite=overwrite)
    _notice(f"PTQ: {len(scales)} layers calibrated on {len(batches)} batches ({q.calib_algo}) -> {out}", echo)
    return PTQResult(out_dir=Path(out), scales=scales, source=src)
