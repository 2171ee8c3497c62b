"""Helpers shared by the export / infer tests (no tests here): tiny models with logits large
enough for argmax comparisons to mean something, a pruned one with per-layer shapes, and a
fake-quant one whose activation scales were learned by QAT's own moving-average update."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from gf_testutil import tiny_config
from gptforge.model import build_model
from gptforge.model_io import save_model_dir
from test_train_support import small_tokenizer

QAT_KEYS = ("Compress.Quantization.enable=true", "Compress.Quantization.activation_preprocess_type=PACT",
            "Compress.Quantization.weight_quantize_type=channel_wise_abs_max")


@torch.no_grad()
def peaky_model(*overrides: str, seed: int = 0):
    """(tiny GPT in eval mode, its config) with N(0, 0.15) weights and biases: logits spread over
    several units, so greedy decoding and argmax agreement are not decided by noise."""
    torch.manual_seed(seed)
    cfg = tiny_config(*overrides)
    model = build_model(cfg.Model)
    for name, p in model.named_parameters():
        if p.dim() == 2 or name.endswith("bias"):
            p.normal_(0.0, 0.15)
    return model.eval(), cfg


@torch.no_grad()
def pruned_model(seed: int = 0):
    """A peaky model with 4 and 2 heads and FFN widths 256 and 128 (per-layer shapes)."""
    from gptforge.transforms.prune import PrunePlan, apply_plan

    model, cfg = peaky_model(seed=seed)
    plan = PrunePlan(heads=[[0, 1, 2, 3], [1, 3]], ffn=[list(range(256)), list(range(0, 256, 2))],
                     orig_heads=[4, 4], orig_ffn=[256, 256])
    apply_plan(model, plan)  # also records the shape in model.config (= cfg.Model)
    assert cfg.Model.layer_num_heads == [4, 2]
    return model, cfg


@torch.no_grad()
def qat_model(*overrides: str, seed: int = 0, steps: int = 16):
    """A fake-quant model (PACT, per-channel weights) whose activation scales come from QAT's
    moving-average update over `steps` training-mode forwards; one PACT alpha binds."""
    from gptforge.transforms.quant import quant_modules, quantize_model

    model, cfg = peaky_model(*QAT_KEYS, *overrides, seed=seed)
    quantize_model(model, cfg.Compress.Quantization)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        model(torch.randint(0, 300, (4, 24), generator=g))
    model.eval()
    mods = quant_modules(model)
    first = mods["blocks.0.linear2"]
    first.pact_alpha.fill_(0.6 * float(first.act_scale))  # the clip binds below the learned range
    return model, cfg


def save(model, cfg, path: Path) -> Path:
    """A model directory (ours) with the small tokenizer."""
    save_model_dir(model, cfg, path, small_tokenizer())
    return path


@functools.cache
def exported(root: str, name: str) -> tuple[Path, Path]:
    """(model directory, its `gptforge export --format onnx` directory), made once per test
    session under `root` (the session's base temp dir) and shared by the export and infer
    tests: `pruned` (fp32, per-layer head counts) or `qat` (INT8 QDQ)."""
    from gptforge.cli import main

    base = Path(root) / f"shared_{name}"
    model, cfg = pruned_model() if name == "pruned" else qat_model()
    src = save(model, cfg, base / "model")
    code = main(["export", "--format", "onnx", "--ckpt", str(src), "--out", str(base / "onnx")])
    assert code == 0
    return src, base / "onnx"

