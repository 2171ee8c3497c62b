"""Size and speed of a model directory, measured the same way for every row of the report."""

from __future__ import annotations

import time
from pathlib import Path

import torch

WEIGHT_GLOBS = ("model*.safetensors", "model.safetensors.index.json")


def size_on_disk(path: str | Path) -> int:
    """Bytes of the model's weight files (a training checkpoint's optimizer state is not counted)."""
    p = Path(path)
    return sum(f.stat().st_size for g in WEIGHT_GLOBS for f in p.glob(g) if f.is_file())


def shape_params(cfg) -> int:
    """Parameters of the architecture (pruned widths included), counted on the meta device."""
    from gptforge.model import build_model

    return sum(t.numel() for t in build_model(cfg.Model, device="meta").parameters())


def describe(model: torch.nn.Module, cfg) -> str:
    """'fp32, 4x128, 4 heads, FFN 512' / 'INT8 (14 of 16 Linears), 4x128, 3 heads, FFN 384'."""
    from gptforge.compress.prune import layer_shapes_of

    heads, ffns = layer_shapes_of(model)
    kinds = [type(m).__name__ for name, m in model.named_modules() if name.count(".") >= 1 and
             name.rsplit(".", 1)[-1] in ("qkv_proj", "out_proj", "linear1", "linear2")]
    q = sum(k.startswith(("Int8", "Quant")) for k in kinds)
    prec = "fp32" if q == 0 else ("INT8" if q == len(kinds) else f"INT8 ({q} of {len(kinds)} Linears)")
    shape = f"{cfg.Model.num_layers}x{cfg.Model.hidden_size}"
    h = f"{heads[0]} heads" if len(set(heads)) == 1 else f"{min(heads)}-{max(heads)} heads"
    f = f"FFN {ffns[0]}" if len(set(ffns)) == 1 else f"FFN {min(ffns)}-{max(ffns)}"
    return f"{prec}, {shape}, {h}, {f}"


@torch.no_grad()
def forward_tokens_per_s(model: torch.nn.Module, batch: int, seq: int, vocab: int, repeats: int = 7) -> float:
    """Scoring throughput: tokens/s of a full forward pass (logits of every position) at
    batch x seq, best of `repeats` after a warm-up, on the model's device."""
    model.eval()
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(dev)
    model(ids)
    best = float("inf")
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model(ids)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return batch * seq / best


def measure_model(path: str | Path, batch: int, seq: int, device: str = "auto") -> dict:
    """{description, params, size_bytes, tokens_per_s} of the model directory at `path`."""
    from gptforge.commands.common import select_device
    from gptforge.model_io import load_model

    model, cfg = load_model(path, device=select_device(device))
    tps = forward_tokens_per_s(model, batch, seq, cfg.Model.vocab_size)
    return {"description": describe(model, cfg), "params": shape_params(cfg), "size_bytes": size_on_disk(path),
            "tokens_per_s": tps}
