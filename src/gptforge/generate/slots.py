"""Per-sequence KV slots and the ragged step that continuous batching (`generate.engine`) runs.

A `SeqSlot` holds one sequence's keys/values, `[1, heads, capacity, head_dim]` per layer, sized
for that sequence alone and freed with it. A `RaggedBatch` is one forward pass over several
sequences: their new tokens (a prefill chunk or one decode token each) are packed into a single
row `[1, sum T_i]`, so every Linear runs once over all of them, and attention is computed per
sequence over its own slot, with exactly the mask a solo `generate` would use (no padding
inside attention). With the backend's batch-invariant Linears this makes each sequence's
logits independent of what shares its batch. A segment may name a served LoRA adapter: the
batch lists each adapter's rows (`adapter_rows`) for the backend to route (adapters.multi).

`SequentialSlots` gives the same interface over any `StepBackend` (e.g. onnxruntime): one
batch-1 cache per sequence and one backend step per sequence and chunk.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gptforge.generate.speculative import truncate_cache
from gptforge.model.gpt import GPT
from gptforge.model.kv_cache import KVCache
from gptforge.transforms import native_kernels

_NATIVE_KV = (torch.float32, torch.int8)  # slot storage the native decode attention reads


class SeqSlot(KVCache):
    """Key/value buffers of one sequence (a batch-1 `KVCache`, in its storage dtype); `length`
    positions are filled."""

    def __init__(self, layer_heads: list[int], capacity: int, head_dim: int, dtype, device):
        # Uninitialized: attention only ever reads the positions this sequence wrote.
        super().__init__(layer_heads, 1, capacity, head_dim, dtype, device, zero=False)

    @property
    def capacity(self) -> int:
        return self.max_len

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions (speculative rollback; later ones are overwritten)."""
        self.length = length

    @classmethod
    def for_model(cls, model: nn.Module, capacity: int, layout: tuple | None = None) -> SeqSlot:
        """A slot shaped like `model`'s cache (`layout`: `slot_layout(model)`, if already known)."""
        heads, head_dim, dtype, device = layout or slot_layout(model)
        return cls(heads, capacity, head_dim, dtype, device)


def slot_layout(model: nn.Module, kv_dtype=None) -> tuple:
    """(heads per layer, head dim, storage dtype, device) of `model`'s KV cache stored in
    `kv_dtype` (None: the model's own). The model's own cache factory knows them (an INT8 model
    keeps float activations; a pruned one has fewer heads)."""
    probe = model.new_cache(1, 1, dtype=kv_dtype)
    return [k.shape[1] for k in probe.k], probe.k[0].shape[-1], probe.k[0].dtype, probe.k[0].device


@dataclass
class Segment:
    """New tokens of one sequence in a ragged step."""

    slot: object
    token_ids: list[int]
    start: int  # position of the first new token (= tokens already in the slot)
    want_logits: bool  # return the logits after its last token
    all_logits: bool = False  # return the logits after every one of its tokens (speculative verification)
    adapter: str | None = None  # the served LoRA adapter its tokens decode with (None: the base)
    # Only the greedy choice of each row of logits it returns is read, among the columns its mask
    # leaves (one `transforms.head_screen.Mask` per row); None: the whole logits are read.
    argmax_masks: list | None = None


class RaggedBatch:
    """The cache object `GPT.hidden_states` sees for one ragged step (it implements `attend`)."""

    def __init__(self, segments: Sequence[Segment], device, native: bool = False):
        self.segments = list(segments)
        ids, pos, want, offset = [], [], [], 0
        self.offsets: list[int] = []
        self.adapter_rows: dict[str, list[int]] = {}  # adapter name -> its rows of the packed row
        filled: dict[int, int] = {}  # a slot may get several consecutive segments (prompt chunks) in one step
        for s in self.segments:
            n = len(s.token_ids)
            have = filled.get(id(s.slot), s.slot.length)
            if have != s.start or s.start + n > s.slot.capacity:
                raise ValueError(f"slot holds {have} of {s.slot.capacity} positions; cannot add {n} "
                                 f"tokens at {s.start}")
            filled[id(s.slot)] = s.start + n
            self.offsets.append(offset)
            ids += s.token_ids
            pos += range(s.start, s.start + n)
            if s.adapter is not None:
                self.adapter_rows.setdefault(s.adapter, []).extend(range(offset, offset + n))
            offset += n
            if s.all_logits:
                want += range(offset - n, offset)
            elif s.want_logits:
                want.append(offset - 1)
        self.input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        self.position_ids = torch.tensor([pos], dtype=torch.long, device=device)
        self.logits_index = torch.tensor(want, dtype=torch.long, device=device)
        wanted = [s for s in self.segments if s.want_logits or s.all_logits]
        # The head may be screened when every row's reader wants only its greedy choice.
        self.argmax_masks = ([m for s in wanted for m in s.argmax_masks]
                             if wanted and all(s.argmax_masks is not None for s in wanted) else None)
        self.length = 0  # read by `hidden_states` as the shared start; positions are explicit here
        # Decode tokens (one new token, the slot's only segment in this step) attend through the
        # native kernel, all in one call per layer, whatever else shares the step.
        once = Counter(id(s.slot) for s in self.segments)
        self.native = [i for i, s in enumerate(self.segments) if native and len(s.token_ids) == 1
                       and once[id(s.slot)] == 1 and s.slot.dtype in _NATIVE_KV]
        self.native_rows = torch.tensor([self.offsets[i] for i in self.native], dtype=torch.long, device=device)
        self.decode_only = len(self.native) == len(self.segments) == len(ids)

    def attend(self, layer: int, q, k, v, core) -> torch.Tensor:
        """Store each sequence's new keys/values in its slot and attend over that slot only (a
        later segment of the same slot sees the keys an earlier one just wrote)."""
        if not self.native or core.training or q.dtype != torch.float32:
            outs = [self._attend_one(layer, i, q, k, v, core) for i in range(len(self.segments))]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        rows = self.native_rows
        if self.decode_only:  # every row a decode token, in order: the heads are read in place
            picked = [x[0].transpose(0, 1) for x in (q, k, v)]  # [R, heads, head_dim], strided
        else:
            picked = [x[0].index_select(1, rows).transpose(0, 1) for x in (q, k, v)]
        slots = [self.segments[i].slot for i in self.native]
        y = native_kernels.decode_attention(*picked, slots, layer, [self.segments[i].start for i in self.native])
        if len(self.native) == len(self.segments):
            return y.transpose(0, 1).unsqueeze(0)
        out = torch.empty_like(q)
        out[0].index_copy_(1, rows, y.transpose(0, 1))
        native = set(self.native)
        for i, s in enumerate(self.segments):
            if i not in native:
                o = self.offsets[i]
                out[:, :, o:o + len(s.token_ids)] = self._attend_one(layer, i, q, k, v, core)
        return out

    def _attend_one(self, layer: int, i: int, q, k, v, core) -> torch.Tensor:
        s, o = self.segments[i], self.offsets[i]
        n, start, slot = len(s.token_ids), s.start, s.slot
        slot.write(layer, start, k[:, :, o:o + n], v[:, :, o:o + n])
        keys, values = slot.read(layer, start + n, q.dtype)
        # Exactly the mask a lone sequence gets from its own KVCache (see `prefill_chunks`).
        mask, causal = GPT.attention_mask(n, start, None, q.device)
        return core(q[:, :, o:o + n], keys, values, mask, causal)

    def commit(self) -> None:
        """Advance every slot past the tokens this step wrote (after the forward pass)."""
        for s in self.segments:
            s.slot.length = max(s.slot.length, s.start + len(s.token_ids))


class RaggedSlots:
    """Continuous-batching steps over a `TorchBackend`: one forward per step for all sequences."""

    ragged = True

    def __init__(self, backend, native: bool | None = None):
        self.backend = backend
        self.device = backend.device
        # The native decode attention where it runs (`native`: None or True), built (once) here
        # rather than at the first decode step; False: the classic per-sequence attention.
        self.native = (native is not False and torch.device(self.device).type == "cpu"
                       and native_kernels.unavailable() is None)

    def new_slot(self, capacity: int):
        return self.backend.new_slot(capacity)

    def step(self, segments: Sequence[Segment]) -> torch.Tensor:
        """Logits [R, V] after the last token of each segment with `want_logits` (after every
        token of one with `all_logits`), in order."""
        return self.backend.step_ragged(RaggedBatch(segments, self.device, self.native))


class _SeqCache:
    def __init__(self, cache, capacity: int):
        self.cache, self.capacity, self.length = cache, capacity, 0

    def truncate(self, length: int) -> None:
        truncate_cache(self.cache, length)
        self.length = length


class SequentialSlots:
    """The same interface over any `StepBackend`: a batch-1 cache per sequence, one backend step
    per segment (sequences take turns within a step; no batching of the matrix products). A
    backend with `step_all` can verify draft tokens (logits of every position)."""

    ragged = False

    def __init__(self, backend):
        self.backend = backend
        self.device = backend.device

    def new_slot(self, capacity: int):
        return _SeqCache(self.backend.new_cache(1, capacity), capacity)

    @torch.inference_mode()
    def step(self, segments: Sequence[Segment]) -> torch.Tensor:
        rows = []
        for s in segments:
            if s.adapter is not None:  # never silently the base's output
                raise ValueError(f"{type(self.backend).__name__} cannot serve LoRA adapters (adapter {s.adapter!r})")
            if s.all_logits and not hasattr(self.backend, "step_all"):  # never silently wrong
                raise ValueError(f"{type(self.backend).__name__} cannot return the logits of every position")
            n = len(s.token_ids)
            ids = torch.tensor([s.token_ids], dtype=torch.long, device=self.device)
            pos = torch.arange(s.start, s.start + n, device=self.device)[None]
            if s.all_logits:
                rows.extend(self.backend.step_all(ids, pos, None, s.slot.cache)[0].float())
            else:
                logits = self.backend.step(ids, pos, None, s.slot.cache)
                if s.want_logits:
                    rows.append(logits[0].float())
            s.slot.length = s.start + n
        if not rows:
            return torch.empty(0, self.backend.vocab_size)
        return torch.stack(rows)


def slots_for(backend) -> RaggedSlots | SequentialSlots:
    """Ragged batching where the backend supports it (our models), else per-sequence steps."""
    if hasattr(backend, "step_ragged") and getattr(backend, "use_cache", True):
        return RaggedSlots(backend)
    return SequentialSlots(backend)

