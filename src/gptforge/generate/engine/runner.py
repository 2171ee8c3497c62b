"""The runner: one ragged step of the model over the slots of any `StepBackend`
(`generate.slots.slots_for`: one packed forward for our models, a step per sequence
otherwise). It turns the scheduler's plan (or a speculative round's work) into `Segment`s and
hands back each piece of work's logits."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from gptforge.generate.slots import Segment


@dataclass
class Work:
    """New tokens of one sequence for one step."""

    seq: object
    tokens: list[int]
    start: int  # position of the first token
    want: bool  # logits after the last token
    all_logits: bool = False  # logits after every token (speculative verification)
    argmax_masks: list | None = None  # only the greedy choices are read (`slots.Segment.argmax_masks`)


def run_step(slots, works: Seq[Work], draft: bool = False) -> list[torch.Tensor | None]:
    """Run `works` in one step of `slots` (the draft's slots with `draft`); per work, its logits
    ([n, V] with `all_logits`, [V] with `want`, else None)."""
    # The draft model proposes without the request's adapter; the target verifies with it.
    segs = [Segment(w.seq.dslot if draft else w.seq.slot, w.tokens, w.start, w.want, w.all_logits,
                    None if draft else w.seq.params.adapter, None if draft else w.argmax_masks) for w in works]
    if not segs:
        return []
    logits = slots.step(segs)
    out: list[torch.Tensor | None] = []
    o = 0
    for w in works:
        if w.all_logits:
            n = len(w.tokens)
            out.append(logits[o:o + n])
            o += n
        elif w.want:
            out.append(logits[o])
            o += 1
        else:
            out.append(None)
    return out


def stack_rows(rows: Seq[torch.Tensor]) -> torch.Tensor:
    """`torch.stack(rows)` of 1-d tensors, as a view without copying when they are consecutive
    rows of one tensor (the plain decodes' logits of a step, in order)."""
    first = rows[0]
    n, width = len(rows), first.shape[-1]
    if first.dim() == 1 and first.stride(0) == 1:
        base, size, storage = first.data_ptr(), width * first.element_size(), first.untyped_storage().data_ptr()
        if all(r.dim() == 1 and r.shape[0] == width and r.stride(0) == 1 and r.dtype == first.dtype
               and r.data_ptr() == base + i * size and r.untyped_storage().data_ptr() == storage
               for i, r in enumerate(rows)):
            return first.as_strided((n, width), (width, 1))
    return torch.stack(list(rows))
