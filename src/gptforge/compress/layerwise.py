"""The block-by-block walk that calibrated weight quantizers (GPTQ, AWQ) share.

Each block's Linears see their inputs in the partly quantized model (the blocks before it
already quantized), a statistic of those inputs is gathered by a forward pre-hook (GPTQ: the
Hessian, AWQ: the inputs themselves), the block is quantized, and its outputs feed the next
block. The tied head comes last, from the final norm's outputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from gptforge.transforms.weight_only import WeightOnlySpec, check_shapes, quantize_layer


class _Stop(Exception):
    pass


def block_inputs(model: nn.Module, batches: list[torch.Tensor]) -> tuple[list, tuple]:
    """Block 0's input for every batch and the (mask, is_causal, ...) the model passes to blocks."""
    got: list = []
    extra: list = []

    def grab(mod, args):
        got.append(args[0])
        extra[:] = args[1:]
        raise _Stop

    h = model.blocks[0].register_forward_pre_hook(grab)
    try:
        for ids in batches:
            with contextlib.suppress(_Stop):
                model(ids)
    finally:
        h.remove()
    return got, tuple(extra)


def _collect(model: nn.Module, names: list[str], stat: Callable, run: Callable[[], object]) -> dict:
    stats = {n: stat(model.get_submodule(n).in_features) for n in names}
    hooks = [model.get_submodule(n).register_forward_pre_hook(stats[n]) for n in names]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return {n: st.value() for n, st in stats.items()}


@torch.no_grad()
def calibrated_walk(model: nn.Module, spec: WeightOnlySpec, batches: list[torch.Tensor], stat: Callable,
                    quantize: Callable[[str, object], None], *, desc: str, head: bool = True,
                    progress: bool = True) -> nn.Module:
    """Quantize `model` in place: `stat(in_features)` makes a hook object (called as a forward
    pre-hook, `.value()` at the end), `quantize(name, value)` swaps the Linear `name` (`wte`:
    the tied head, when `head` and `head_bits` is 4 or 8; else the head is rounded to nearest)."""
    from gptforge.model.gpt import BLOCK_LINEARS
    from gptforge.progress import bar

    check_shapes(model, spec)
    model.eval()
    xs, extra = block_inputs(model, batches)
    pbar = bar(total=len(model.blocks) + 1, desc=desc, unit="layer", enabled=progress)
    for i, blk in enumerate(model.blocks):
        names = [f"blocks.{i}.{p}" for p in BLOCK_LINEARS]
        if spec.bits == 16:  # a cast: nothing to calibrate
            for n in names:
                quantize_layer(model, n, spec)
        else:
            values = _collect(model, names, stat, lambda b=blk, xs=xs: [b(x, *extra) for x in xs])
            for n in names:
                quantize(n, values[n])
        xs = [blk(x, *extra) for x in xs]  # the quantized block's outputs feed the next block
        pbar.update(1)
    if head and spec.bits_for("wte") in (4, 8):
        st = stat(model.wte.embedding_dim)
        for x in xs:
            st(None, (model.norm(x),))
        quantize("wte", st.value())
    else:
        quantize_layer(model, "wte", spec)
    pbar.update(1)
    pbar.close()
    return model
