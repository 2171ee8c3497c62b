"""Size and speed of a model directory, measured the same way for every row of the report."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from gptforge.model.gpt import block_linears

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
    from gptforge.transforms.prune import layer_shapes_of

    heads, ffns = layer_shapes_of(model)
    kinds = [type(m).__name__ for _, m in block_linears(model)]
    q = sum(k.startswith(("Int8", "Quant")) for k in kinds)
    prec = "fp32" if q == 0 else ("INT8" if q == len(kinds) else f"INT8 ({q} of {len(kinds)} Linears)")
    shape = f"{cfg.Model.num_layers}x{cfg.Model.hidden_size}"
    h = f"{heads[0]} heads" if len(set(heads)) == 1 else f"{min(heads)}-{max(heads)} heads"
    f = f"FFN {ffns[0]}" if len(set(ffns)) == 1 else f"FFN {min(ffns)}-{max(ffns)}"
    return f"{prec}, {shape}, {h}, {f}"


@torch.no_grad()
def forward_seconds(model: torch.nn.Module, ids: torch.Tensor, repeats: int) -> float:
    """Best wall time of `repeats` full forward passes (logits of every position)."""
    dev = ids.device
    best = float("inf")
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model(ids)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def measure_models(paths: dict[str, str | Path], batch: int, seq: int, device: str = "auto",
                   rounds: int = 5, repeats: int = 3) -> dict[str, dict]:
    """{key: {description, params, size_bytes, tokens_per_s, tokens_per_s_rounds}} for model directories.

    Speed is scoring throughput: tokens/s of a full forward pass at batch x seq on one random
    batch. The models are timed in interleaved rounds (each round times every model, best of
    `repeats` passes), so a disturbance on a busy machine hits all of them alike; `tokens_per_s` is
    the median of the rounds and `tokens_per_s_rounds` keeps every round for the spread.
    """
    from gptforge.device import select_device
    from gptforge.model_io import load_model

    dev = select_device(device)
    models, out = {}, {}
    for key, path in paths.items():
        model, cfg = load_model(path, device=dev)
        models[key] = model.eval()
        out[key] = {"description": describe(model, cfg), "params": shape_params(cfg),
                    "size_bytes": size_on_disk(path)}
    vocab = min(m.wte.weight.shape[0] for m in models.values())
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(dev)
    per_round: dict[str, list[float]] = {k: [] for k in models}
    for m in models.values():
        forward_seconds(m, ids, 1)  # warm-up: allocator, kernel choice, packing
    for _ in range(rounds):
        for k, m in models.items():
            per_round[k].append(batch * seq / forward_seconds(m, ids, repeats))
    for k, rates in per_round.items():
        out[k]["tokens_per_s"] = statistics.median(rates)
        out[k]["tokens_per_s_rounds"] = rates
    return out


def compare_speeds(a: list[float], b: list[float]) -> int:
    """+1 if every round of `a` beats every round of `b`, -1 for the reverse, 0 if the spreads
    (min..max over rounds) overlap: no measurable difference."""
    if min(a) > max(b):
        return 1
    if max(a) < min(b):
        return -1
    return 0
