"""The `gptforge prune` pipeline: load → prune (→ 2:4) (→ fake-quant) → fine-tune → save.

Order (spec §10.2): the model is built with the shape of `Compress.pretrained`, the trainer
loads those weights, then this module's transform scores and cuts heads / neurons, records
the new shape in the run config (so every checkpoint the trainer writes loads without
re-pruning), optionally makes the block Linears 2:4 sparse and inserts fake-quant modules
(prune → QAT in one run), and only then does the trainer set up precision and the
optimizer, which sees only the pruned tensors. 2:4 masks are kept by gradient and optimizer
hooks during fine-tuning.

Resuming (`resume`): the shape comes from the checkpoint and nothing is pruned again; the 2:4
masks are re-derived from the saved zeros.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gptforge.config.schema import Config
from gptforge.errors import ConfigError
from gptforge.transforms.prune import PruneReport, check_ratio, prune_model, record_shape
from gptforge.transforms.prune_scores import CALIBRATED, check_criterion
from gptforge.transforms.sparsity import SparsityKeeper, check_method, compute_masks, masks_from_weights

REPORT_FILE = "prune_report.json"


@dataclass
class PruneRun:
    """What `prune_and_finetune` did."""

    model: nn.Module
    cfg: Config
    report: PruneReport | None
    train: object | None  # gptforge.train.TrainResult (None when Engine.max_steps is 0)
    sparsity: float | None = None
    checkpoint_dir: Path | None = None
    pruned_dir: Path | None = None
    tokenizer: object = None
    info: dict = field(default_factory=dict)


def _notice(msg: str, echo: bool = True) -> None:
    if echo:
        print(f"gptforge: {msg}", file=sys.stderr)


def check_prune_config(cfg: Config) -> None:
    """Validate `Compress.Prune` before any work is done."""
    p = cfg.Compress.Prune
    if not p.enable:
        raise ConfigError("Compress.Prune.enable: False; set -o Compress.Prune.enable=True to prune")
    check_criterion(p.criterion)
    for name in ("ratio", "head_ratio", "ffn_ratio"):
        if getattr(p, name) is not None:
            check_ratio(name, getattr(p, name))
    if p.scope not in ("uniform", "global"):
        raise ConfigError(f"Compress.Prune.scope: {p.scope!r} is not one of uniform, global")
    if p.semi_structured:
        check_method(p.semi_structured)
    if p.calib_batches < 1 and (p.criterion in CALIBRATED or p.semi_structured == "wanda"):
        raise ConfigError(f"Compress.Prune.calib_batches: must be >= 1 for criterion {p.criterion} / "
                          f"semi_structured {p.semi_structured}, got {p.calib_batches}")


def calibration_batches(cfg: Config, tokenizer, n: int) -> list[dict]:
    """The first `n` micro-batches of the Train split (what the first training steps see)."""
    from gptforge.data.dataset import build_datasets, collate, default_num_samples

    mbs = cfg.Global.micro_batch_size
    need = max(n * mbs, default_num_samples(cfg, "Train"))
    ds = build_datasets(cfg, ("Train",), num_samples={"Train": need}, tokenizer=tokenizer)["Train"]
    return [collate([ds[k * mbs + j] for j in range(mbs)]) for k in range(n)]


def _quantize(model: nn.Module, cfg: Config) -> nn.Module:
    try:
        from gptforge.transforms.quant import quantize_model
    except ImportError as e:
        raise ConfigError(f"Compress.Quantization.enable with pruning: quantization is unavailable ({e})") from None
    out = quantize_model(model, cfg.Compress.Quantization)
    return model if out is None else out


def _copy_shape(dst_model_cfg, src_model_cfg) -> None:
    from gptforge.config import ARCH_KEYS

    for k in ARCH_KEYS:
        setattr(dst_model_cfg, k, getattr(src_model_cfg, k))


def _write_report(out_dir: Path, info: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{REPORT_FILE}.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / REPORT_FILE)


def _float_cfg(cfg: Config) -> Config:
    """`cfg` describing the float (not yet fake-quantized) model."""
    comp = dataclasses.replace(cfg.Compress, Quantization=dataclasses.replace(cfg.Compress.Quantization, enable=False))
    return dataclasses.replace(cfg, Compress=comp, Model=dataclasses.replace(cfg.Model))


def prune_and_finetune(cfg: Config, tokenizer=None, *, resume=None, save_pruned: str | os.PathLike | None = None,
                       progress: bool | None = None, echo: bool = True, overrides=(), force: bool = False) -> PruneRun:
    """Prune `Compress.pretrained` following `Compress.Prune`, then fine-tune it with the trainer.

    `cfg` is updated in place with the pruned shape. `save_pruned` writes the model right
    after surgery (before fine-tuning) as a model directory; with `Engine.max_steps: 0` there is
    no fine-tuning and the pruned model goes to `save_pruned` (default `<output_dir>/pruned`).
    The output directory is locked for the whole run (`run_lock`); `overrides` (the `-o`
    strings) that change the shape of a resumed checkpoint are refused; `force` starts over in an
    output directory holding another run's checkpoints (`run_start.plan_start` decides).
    """
    from gptforge.run_lock import lock_dir
    from gptforge.train.run_start import plan_start

    check_prune_config(cfg)
    with lock_dir(Path(cfg.Engine.save_load.output_dir).expanduser(), "prune"):
        start = plan_start(cfg, resume=resume, force=force, overrides=overrides, echo=echo)
        return _prune_and_finetune(cfg, tokenizer, start, save_pruned, progress, echo)


def _prune_and_finetune(cfg: Config, tokenizer, start, save_pruned, progress, echo) -> PruneRun:
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.device import select_device
    from gptforge.model import build_model
    from gptforge.model_io import checkpoint_model_config, resolve_checkpoint_path, save_model_dir
    from gptforge.train import Trainer, load_pretrained

    p, out_dir = cfg.Compress.Prune, start.output_dir
    resume_dir = start.resume
    if resume_dir is not None:
        source = resume_dir
    elif cfg.Compress.pretrained:
        source = resolve_checkpoint_path(cfg.Compress.pretrained)
    else:
        raise ConfigError("Compress.pretrained: not set; pruning starts from a trained model: "
                          "-o Compress.pretrained=DIR (or --ckpt DIR)")
    _copy_shape(cfg.Model, checkpoint_model_config(source, fallback=cfg.Model))
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.Data.tokenizer, source if source.is_dir() else None)
    device = select_device(cfg.Global.device)
    info: dict = {"source": str(source), "criterion": p.criterion, "scope": p.scope,
                  "head_ratio": p.head_ratio, "ffn_ratio": p.ffn_ratio, "semi_structured": p.semi_structured}
    state: dict = {"report": None, "masks": None, "pruned_dir": None}
    if save_pruned is None and cfg.Engine.max_steps == 0 and resume_dir is None:
        save_pruned = out_dir / "pruned"

    def transform(model: nn.Module) -> nn.Module:
        model = model.to(device)
        if resume_dir is None:
            needs_data = p.criterion in CALIBRATED or p.semi_structured == "wanda"
            batches = calibration_batches(cfg, tokenizer, p.calib_batches) if needs_data else None
            report = prune_model(model, p, batches)
            record_shape(cfg.Model, model)
            state["report"] = report
            _notice(f"pruned ({p.criterion}, {p.scope}): {report.plan.summary()}; parameters "
                    f"{report.params_before / 1e6:.2f}M -> {report.params_after / 1e6:.2f}M", echo)
            if p.semi_structured:
                state["masks"] = compute_masks(model, p.semi_structured, batches)
                SparsityKeeper(model, state["masks"]).apply()
            if save_pruned is not None:
                state["pruned_dir"] = save_model_dir(model, _float_cfg(cfg), save_pruned, tokenizer, overwrite=True)
        if cfg.Compress.Quantization.enable:
            model = _quantize(model, cfg)
        return model

    if cfg.Engine.max_steps == 0 and resume_dir is None:
        model = build_model(cfg.Model)
        load_pretrained(model, source, cfg)
        model = transform(model)
        train, trained, last = None, model, None
    else:
        trainer = Trainer(cfg, build_model(cfg.Model), tokenizer, transform=transform, start=start,
                          progress=progress, echo=echo, verb="prune")
        keeper = None
        if p.semi_structured:
            masks = state["masks"] if resume_dir is None else masks_from_weights(trainer.model)
            keeper = SparsityKeeper(trainer.model, masks).attach(trainer.optimizer)
        try:
            train = trainer.train()
        finally:
            if keeper is not None:
                keeper.detach()
        trained, last = trainer.model, train.checkpoint_dir
    report: PruneReport | None = state["report"]
    sparsity = None
    if p.semi_structured:
        keeper = SparsityKeeper(trained, masks_from_weights(trained))
        keeper.check()
        sparsity = keeper.sparsity()
    if report is not None:
        plan = report.plan
        info.update(params_before=report.params_before, params_after=report.params_after,
                    orig_heads=plan.orig_heads, layer_heads=plan.layer_heads, kept_heads=plan.heads,
                    removed_heads=plan.removed_heads(), orig_ffn=plan.orig_ffn, layer_ffn=plan.layer_ffn)
    info.update(sparsity_2_4=sparsity, checkpoint=str(last) if last else None,
                pruned_dir=str(state["pruned_dir"]) if state["pruned_dir"] else None)
    if resume_dir is None:
        _write_report(out_dir, info)
    return PruneRun(model=trained, cfg=cfg, report=report, train=train, sparsity=sparsity,
                    checkpoint_dir=last, pruned_dir=state["pruned_dir"], tokenizer=tokenizer, info=info)


def forward_tokens_per_s(model: nn.Module, batch_size: int, seq_len: int, repeats: int = 5,
                         vocab: int | None = None) -> float:
    """Forward-pass throughput (tokens/s) on a fixed random batch: median of `repeats` timings."""
    import time

    device = next(model.parameters()).device
    vocab = vocab or model.wte.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device)
    was_training = model.training
    model.eval()
    times = []
    with torch.no_grad():
        model(x)  # warm-up
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    model.train(was_training)
    times.sort()
    return batch_size * seq_len / times[len(times) // 2]
