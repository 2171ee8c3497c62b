"""The native decode attention (`csrc/decode_attention.cpp`, used by `generate/slots.py`): each
new token's key/value stored in its sequence's slot exactly as `KVCache.write` stores it, and
softmax(q·k/√d)·v over the slot's positions within fp32 rounding of a float64 reference, on
every instruction-set path this CPU runs (forced in turn), bit-identical whatever the thread
count or the other sequences in the call."""

from __future__ import annotations

import pytest
import torch

from gf_testutil import skip_unless_runs
from gptforge.generate.slots import SeqSlot
from gptforge.model.kv_cache import dequantize_int8
from gptforge.transforms import native_kernels

PATHS = ("scalar", "avx2", "avx512")


def _slots(starts, heads, dim, dtype, seed=0, key_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    slots = []
    for n in starts:
        s = SeqSlot([heads, heads], max(starts) + 3, dim, dtype, "cpu")
        for layer in range(2):
            s.write(layer, 0, torch.randn(1, heads, n, dim, generator=g) * key_scale,
                    torch.randn(1, heads, n, dim, generator=g))
        s.length = n
        slots.append(s)
    return slots


def _reference(slot, layer, q, end):
    """float64 softmax attention of q [heads, dim] over positions 0..end-1 of the slot."""
    k, v = slot.read(layer, end, torch.float32)
    k, v = k[0].double(), v[0].double()
    w = torch.softmax((k @ q.double()[:, :, None])[..., 0] / q.shape[-1] ** 0.5, dim=-1)
    return (w[:, :, None] * v).sum(1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("dim", [64, 48, 12])  # 48: no register sums on AVX-512; 12: no vector path
def test_matches_reference_and_stores_like_kvcache(built, path, dtype, dim):
    skip_unless_runs(path, built)
    starts, heads = [0, 7, 1, 40, 3], 3
    ours, ref_slots = _slots(starts, heads, dim, dtype), _slots(starts, heads, dim, dtype)
    q, k, v = (torch.randn(len(starts), heads, dim) for _ in range(3))
    y = native_kernels.decode_attention(q, k, v, ours, 1, starts, path=path)
    for r, (a, b, n) in enumerate(zip(ours, ref_slots, starts, strict=True)):
        b.write(1, n, k[r][None, :, None], v[r][None, :, None])  # what the classic path stores
        for x, z in ((a.k, b.k), (a.v, b.v), (a.k_scale, b.k_scale), (a.v_scale, b.v_scale)):
            if x is not None:
                assert torch.equal(x[1][:, :, :n + 1], z[1][:, :, :n + 1])
        assert torch.equal(a.k[0][:, :, :n], b.k[0][:, :, :n])  # the other layer untouched
        torch.testing.assert_close(y[r].double(), _reference(b, 1, q[r], n + 1), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_long_contexts_and_peaked_scores_match_reference(built, path, dtype):
    """The softmax's vector passes and their one-by-one rest (exp_poly.h's exponential): contexts of
    every length mod 16 up to 300 positions, keys large enough that most weights underflow."""
    skip_unless_runs(path, built)
    starts, heads, dim = [15, 16, 17, 130, 255, 299], 2, 64
    for key_scale in (1.0, 12.0):
        ours = _slots(starts, heads, dim, dtype, key_scale=key_scale)
        ref_slots = _slots(starts, heads, dim, dtype, key_scale=key_scale)
        q, k, v = (torch.randn(len(starts), heads, dim) * key_scale for _ in range(3))
        y = native_kernels.decode_attention(q, k, v, ours, 1, starts, path=path)
        for r, (b, n) in enumerate(zip(ref_slots, starts, strict=True)):
            b.write(1, n, k[r][None, :, None], v[r][None, :, None])
            ref = _reference(b, 1, q[r], n + 1)
            torch.testing.assert_close(y[r].double(), ref, rtol=2e-6, atol=2e-6 * key_scale)


@pytest.mark.parametrize("path", PATHS)
def test_a_nan_key_makes_its_head_nan_as_in_the_reference(built, path):
    """A NaN among a head's keys (a diverged model's fp32 cache) reaches that head's output, at a
    position the vector passes take and at one of the rest, never turned into a weight of ~0."""
    skip_unless_runs(path, built)
    starts, heads, dim = [20, 20], 2, 64
    slots = _slots(starts, heads, dim, torch.float32)
    slots[0].k[0][0, 0, 3, 7] = float("nan")  # row 0, head 0: among the first 16 positions
    slots[1].k[0][0, 1, 18, 0] = float("nan")  # row 1, head 1: past them
    q, k, v = (torch.randn(len(starts), heads, dim) for _ in range(3))
    y = native_kernels.decode_attention(q, k, v, slots, 0, starts, path=path)
    assert torch.isnan(y[0, 0]).all() and torch.isnan(y[1, 1]).all()
    assert torch.isfinite(y[0, 1]).all() and torch.isfinite(y[1, 0]).all()


@pytest.mark.parametrize("path", PATHS)
def test_invariant_to_threads_and_company(built, path):
    skip_unless_runs(path, built)
    starts, heads, dim = [5, 33, 2, 17, 64, 9, 1, 30], 4, 64
    q, k, v = (torch.randn(len(starts), heads, dim) for _ in range(3))
    n = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(native_kernels.decode_attention(q, k, v, _slots(starts, heads, dim, torch.float32), 0, starts,
                                                        path=path))
    finally:
        torch.set_num_threads(n)
    assert torch.equal(outs[0], outs[1])
    alone = [native_kernels.decode_attention(q[r:r + 1], k[r:r + 1], v[r:r + 1],
                                             [_slots(starts, heads, dim, torch.float32)[r]], 0, [starts[r]], path=path)
             for r in range(len(starts))]
    assert torch.equal(torch.cat(alone), outs[0])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_strided_heads_read_in_place(built, path, dtype):
    """q, k, v as the model hands them over (one qkv projection per row, each head's [q | k | v]
    side by side; rows picked from a longer step): the same slots and the same bits as contiguous
    copies, and the kernel reads the views, not copies of them."""
    skip_unless_runs(path, built)
    starts, heads, dim = [4, 19, 0, 8], 3, 64
    qkv = torch.randn(2 * len(starts), heads, 3 * dim)[::2]  # [R, heads, 3 * dim], rows strided too
    views = [qkv.narrow(2, i * dim, dim) for i in range(3)]
    assert not views[0].is_contiguous()
    ours, ref_slots = _slots(starts, heads, dim, dtype), _slots(starts, heads, dim, dtype)
    y = native_kernels.decode_attention(*views, ours, 0, starts, path=path)
    ref = native_kernels.decode_attention(*(x.contiguous() for x in views), ref_slots, 0, starts, path=path)
    assert torch.equal(y, ref) and y.is_contiguous()
    for a, b, n in zip(ours, ref_slots, starts, strict=True):
        for x, z in ((a.k, b.k), (a.v, b.v), (a.k_scale, b.k_scale), (a.v_scale, b.v_scale)):
            if x is not None:
                assert torch.equal(x[0][:, :, :n + 1], z[0][:, :, :n + 1])
    fresh = _slots(starts, heads, dim, dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        native_kernels.decode_attention(*views, fresh, 0, starts, path=path)
    assert not {e.key for e in prof.key_averages()} & {"aten::clone", "aten::contiguous", "aten::copy_"}


def test_int8_read_matches_dequantized_slot(built):
    """int8 slots: the kernel attends over exactly the values `dequantize_int8` gives."""
    starts, heads, dim = [6, 11], 2, 64
    slots = _slots(starts, heads, dim, torch.int8)
    q, k, v = (torch.randn(2, heads, dim) for _ in range(3))
    y = native_kernels.decode_attention(q, k, v, slots, 0, starts)
    for r, (s, n) in enumerate(zip(slots, starts, strict=True)):
        kd = dequantize_int8(s.k[0][:, :, :n + 1], s.k_scale[0][:, :, :n + 1], torch.float32)
        vd = dequantize_int8(s.v[0][:, :, :n + 1], s.v_scale[0][:, :, :n + 1], torch.float32)
        w = torch.softmax((kd[0].double() @ q[r].double()[:, :, None])[..., 0] / dim ** 0.5, dim=-1)
        torch.testing.assert_close(y[r].double(), (w[:, :, None] * vd[0].double()).sum(1), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("path", ["avx2", "avx512"])
def test_int8_writes_of_non_finite_values_are_the_scalar_paths_bytes(built, path):
    """A key or value with NaN or infinite entries (a diverged model) is stored with the scalar
    path's bytes and scale on the vector paths too (their max and clamp keep std::max's NaN rule)."""
    skip_unless_runs(path, built)
    starts, heads, dim = [2], 4, 64
    k, v = torch.randn(1, heads, dim), torch.randn(1, heads, dim)
    k[0, 0, 5], k[0, 1, 9], k[0, 2, 0] = float("nan"), float("inf"), -float("inf")
    v[0, 3, 63], v[0, 1, :] = float("nan"), float("inf")
    q = torch.randn(1, heads, dim)
    stored = []
    for p in ("scalar", path):
        slots = _slots(starts, heads, dim, torch.int8)
        native_kernels.decode_attention(q, k, v, slots, 0, starts, path=p)
        s = slots[0]
        stored.append([t[0][:, :, 2].clone() for t in (s.k, s.v, s.k_scale, s.v_scale)])
    for a, b in zip(*stored, strict=True):
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.nan_to_num(), b.nan_to_num()))


def test_rejects_bad_operands(built):
    slots = _slots([3], 2, 64, torch.float32)
    q = torch.randn(1, 2, 64)
    with pytest.raises(RuntimeError, match="outside its capacity"):
        native_kernels.decode_attention(q, q, q, slots, 0, [slots[0].capacity])
    with pytest.raises(RuntimeError, match="one slot and start per row"):
        native_kernels.decode_attention(q, q, q, slots, 0, [3, 4])
