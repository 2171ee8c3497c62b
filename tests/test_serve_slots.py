"""Per-sequence KV slots and the ragged step (`generate/slots.py`): a sequence's logits are
bit-identical to decoding it alone, whatever shares its step and however prefill is scheduled."""

from __future__ import annotations

import random

import pytest
import torch

from gf_testutil import tiny_model
from gptforge.generate.backend import PREFILL_CHUNK, TorchBackend, prefill_chunks
from gptforge.generate.slots import RaggedSlots, Segment, SequentialSlots

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = (1, 2, 5, 31, 32, 33, 64, 70, 129)
NEW = 6


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m, _ = tiny_model()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    return m


def _solo(m, prompt):
    """Logits of each step decoding `prompt` alone with the generate path (prefill, then greedy)."""
    out = []
    with TorchBackend(m) as be:
        cache = be.new_cache(1, len(prompt) + NEW)
        logits = be.step(torch.tensor([prompt]), torch.arange(len(prompt))[None], None, cache)
        for t in range(NEW):
            out.append(logits[0].clone())
            nxt = logits.argmax(-1, keepdim=True)
            logits = be.step(nxt, torch.tensor([[len(prompt) + t]]), None, cache)
    return out


def _served(slots, prompts, seed):
    """Decode all prompts together, joining in random order with random prefill budgets."""
    rng = random.Random(seed)
    seqs = [{"p": p, "slot": slots.new_slot(len(p) + NEW), "chunks": prefill_chunks(len(p)), "gen": [], "lg": []}
            for p in prompts]
    waiting = list(seqs)
    rng.shuffle(waiting)
    running = []
    while waiting or running:
        running += [waiting.pop() for _ in range(min(len(waiting), rng.randint(0, 3)))]
        segs, owners, budget = [], [], PREFILL_CHUNK * rng.randint(1, 3)
        for s in running:
            if not s["chunks"]:
                segs.append(Segment(s["slot"], [s["gen"][-1]], s["slot"].length, True))
                owners.append(s)
            elif s["chunks"][0][1] - s["chunks"][0][0] <= budget:
                a, b = s["chunks"].pop(0)
                budget -= b - a
                segs.append(Segment(s["slot"], s["p"][a:b], a, not s["chunks"]))
                if not s["chunks"]:
                    owners.append(s)
        if not segs:
            continue
        for s, row in zip(owners, slots.step(segs), strict=True):
            s["lg"].append(row.clone())
            s["gen"].append(int(row.argmax()))
        running = [s for s in running if len(s["gen"]) < NEW]
    return seqs


@pytest.mark.parametrize("seed", [0, 1])
def test_ragged_steps_are_bit_identical_to_decoding_alone(model, seed):
    """Without the native decode attention, each sequence's logits equal the classic batch-1
    KVCache path's bit for bit."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.wte.weight.shape[0], (n,), generator=g).tolist() for n in LENGTHS]
    with TorchBackend(model) as be:
        served = _served(RaggedSlots(be, native=False), prompts, seed)
    for p, s in zip(prompts, served, strict=True):
        ref = _solo(model, p)
        assert all(torch.equal(a, b) for a, b in zip(ref, s["lg"], strict=True)), len(p)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_native_decode_attention_is_batch_invariant(model, seed, kv, built):
    """With the native decode attention (one kernel call per layer for every decode token),
    a sequence's logits equal those of decoding it alone through the same slots, bit for bit,
    whatever shares its steps, and stay within fp32 rounding of the classic path."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.wte.weight.shape[0], (n,), generator=g).tolist() for n in LENGTHS]
    with TorchBackend(model, kv_cache_dtype=kv) as be:
        served = _served(RaggedSlots(be, native=True), prompts, seed)
        for p, s in zip(prompts, served, strict=True):
            alone = _served(RaggedSlots(be, native=True), [p], seed)[0]
            assert all(torch.equal(a, b) for a, b in zip(alone["lg"], s["lg"], strict=True)), len(p)
            classic = _served(RaggedSlots(be, native=False), [p], seed)[0]
            for a, b in zip(classic["lg"], s["lg"], strict=True):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_sequential_slots_over_any_backend_agree(model):
    prompts = [torch.randint(0, 4096, (n,)).tolist() for n in (3, 40)]
    with TorchBackend(model, prepack=False) as be:
        be.step_ragged = None  # only the StepBackend protocol is used
        served = _served(SequentialSlots(be), prompts, 0)
    for p, s in zip(prompts, served, strict=True):
        with TorchBackend(model, prepack=False) as be:
            cache = be.new_cache(1, len(p) + NEW)
            ref = be.step(torch.tensor([p]), torch.arange(len(p))[None], None, cache)[0]
        assert torch.allclose(s["lg"][0], ref, atol=1e-5)


def test_a_slot_is_sized_for_its_sequence(model):
    with TorchBackend(model) as be:
        slots = RaggedSlots(be)
        slot = slots.new_slot(10)
        assert slot.capacity == 10 and slot.k[0].shape[2] == 10
        slots.step([Segment(slot, [1, 2, 3], 0, True)])
        assert slot.length == 3
        with pytest.raises(ValueError, match="cannot add"):
            slots.step([Segment(slot, list(range(8)), 3, True)])
