"""gptforge's own CPU kernels for weight-only int8 / int4 layers (`transforms/native_kernels.py`,
`csrc/weight_only_gemv.cpp`). Every instruction-set path is forced in turn (`GPTFORGE_NATIVE_ISA`)
and compared with the float64 product of the dequantized weights (`lowbit.dequantize`, the
format's definition), which the kernels must equal within fp32 rounding. A path this CPU cannot
execute is skipped (it would stop on an illegal instruction); the library is built once per test
session into the session's tmp directory (conftest)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from gf_testutil import ISA_ORDER, skip_unless_runs
from gf_testutil import within_fp32_rounding as _tolerance_check
from gptforge.errors import UsageError
from gptforge.transforms import lowbit, native_kernels
from gptforge.transforms.weight_only import (
    KERNEL_ENV,
    NATIVE_CHUNKED_ROWS,
    NATIVE_MAX_ROWS,
    WeightOnlyEmbedding,
    WeightOnlyLinear,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# (bits, group size, symmetric, in, out): per row, grouped, odd widths (vector tails), groups
# that are not a multiple of the vector block, tiny layers; and rows of 25 / 33 groups, whose
# offsets' share is summed 8 or 16 groups per vector with a tail of single groups.
FORMATS = [(8, 0, True, 96, 40), (8, 32, False, 96, 40), (8, 24, True, 72, 9), (8, 0, True, 37, 5),
           (4, 32, True, 128, 33), (4, 64, False, 128, 16), (4, 0, True, 70, 11), (4, 6, False, 30, 7),
           (4, 48, True, 96, 3), (4, 32, False, 800, 9), (4, 32, True, 800, 6), (8, 32, False, 1056, 7)]


@pytest.mark.parametrize("path", ISA_ORDER)
@pytest.mark.parametrize("bits,group,sym,k,n", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("bias", [True, False])
def test_every_path_equals_the_dequantized_reference(built, path, bits, group, sym, k, n, rows, bias):
    skip_unless_runs(path, built)
    w = torch.randn(n, k) * torch.rand(n, 1)  # rows of different magnitudes
    q, s, z = lowbit.quantize_rtn(w, bits, group, sym)
    packed = lowbit.pack_int4(q) if bits == 4 else q
    b = torch.randn(n) if bias else None
    x = torch.randn(rows, k)
    y = native_kernels.weight_only_linear(x, packed, s, None if sym else z.to(torch.int8), b, bits, path)
    _tolerance_check(y, x, lowbit.dequantize(q, s, z, group), b)


@pytest.mark.parametrize("path", ["avx512", "scalar"])
@pytest.mark.parametrize("group,sym", [(32, True), (64, False), (128, True)])
def test_int4_rows_have_the_same_bits_in_any_batch(built, path, group, sym):
    """On AVX-512 (each group's 16 dequantized values looked up, two sums per row at every batch
    size) and on the scalar path, a row's int4 product does not depend on the rows beside it: one
    row alone = the same row among 2..8, bit for bit (AVX2 sums one row in two halves, several in one)."""
    skip_unless_runs(path, built)
    n, k = 45, 384
    w = torch.randn(n, k) * torch.rand(n, 1)
    q, s, z = lowbit.quantize_rtn(w, 4, group, sym)
    args = (lowbit.pack_int4(q), s, None if sym else z.to(torch.int8), torch.randn(n), 4, path)
    x = torch.randn(8, k)
    alone = torch.cat([native_kernels.weight_only_linear(x[i:i + 1], *args) for i in range(8)])
    for rows in range(2, 9):
        assert torch.equal(native_kernels.weight_only_linear(x[:rows], *args), alone[:rows]), rows


@pytest.mark.parametrize("path", ISA_ORDER)
@pytest.mark.parametrize("bits,group,q8a", [(8, 0, False), (4, 64, False), (8, 0, True), (4, 32, True)])
@pytest.mark.parametrize("rows", [1, 2])
def test_many_rows_on_two_threads(built, path, bits, group, q8a, rows):
    """Enough output rows for the vector paths' row blocks, their prefetching ahead and the end
    of the matrix, split between two threads at boundaries that are not multiples of a block."""
    skip_unless_runs(path, built)
    n, k = 1003, 256
    w = torch.randn(n, k) * torch.rand(n, 1)
    q, s, z = lowbit.quantize_rtn(w, bits, group, True)
    x = torch.randn(rows, k)
    before = torch.get_num_threads()
    ys = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            ys.append(native_kernels.weight_only_linear(x, lowbit.pack_int4(q) if bits == 4 else q, s, None, None,
                                                        bits, path, q8_activations=q8a))
    finally:
        torch.set_num_threads(before)
    y = ys[0]
    assert torch.equal(ys[0], ys[1])  # one output is always one task's: the split changes no bit
    if not q8a:
        _tolerance_check(y, x, lowbit.dequantize(q, s, z, group), None)
        return
    xq, d, ref = _q8a_reference(x, q, s, None, group, bits)
    size = (xq.abs().double() * d.repeat_interleave(32, 1)) @ (q.abs().double() + 8).T * s.abs().max()
    assert bool(((y.double() - ref).abs() <= 1e-5 * ref.abs() + 2e-6 * size + 1e-7).all())


def test_the_kernels_run_on_torchs_threads(built):
    """The library shares torch's thread pool: built without OpenMP, at::parallel_for would run
    every kernel on one thread whatever torch.set_num_threads says (it did, until this test)."""
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            assert native_kernels.threads_used(64) == threads
    finally:
        torch.set_num_threads(before)


def test_the_extremes_of_every_format(built):
    """Every stored value and the zeros at both ends (int4 nibbles 0 and 15, int8 -128 / 127)."""
    for bits in (4, 8):
        lo, hi = lowbit.qrange(bits)
        q = torch.arange(lo, hi + 1, dtype=torch.int8).repeat(6, 256 // (hi - lo + 1))
        s = torch.rand(6, 4) + 0.1
        z = torch.tensor([lo, hi, 0, -1, lo + 1, hi - 1], dtype=torch.int8)[:, None].expand(6, 4).contiguous()
        x = torch.randn(2, q.shape[1])
        packed = lowbit.pack_int4(q) if bits == 4 else q
        for path in ISA_ORDER[:ISA_ORDER.index(built) + 1]:
            y = native_kernels.weight_only_linear(x, packed, s, z, None, bits, path)
            _tolerance_check(y, x, lowbit.dequantize(q, s, z, q.shape[1] // 4), None)


@pytest.mark.parametrize("path", ISA_ORDER)
@pytest.mark.parametrize("bits,group,sym", [(8, 0, True), (8, 32, False), (4, 32, True), (4, 64, False)])
def test_layers_take_the_forced_path(monkeypatch, built, path, bits, group, sym):
    skip_unless_runs(path, built)
    monkeypatch.setenv(KERNEL_ENV, "native")
    monkeypatch.setenv(native_kernels.ISA_ENV, path)
    lin = WeightOnlyLinear.from_float(torch.randn(24, 128), torch.randn(24), bits, group, sym,
                                      act_scale=torch.rand(128) + 0.5)
    x = torch.randn(2, 3, 128)
    assert lin.kernel_for(x.reshape(-1, 128)) == "native" and native_kernels.isa() == path
    _tolerance_check(lin(x).reshape(6, 24), (x / lin.act_scale).reshape(6, 128), lin._stored(torch.float32),
                     lin.bias)
    emb = WeightOnlyEmbedding(40, 128, bits=bits, group_size=group, sym=sym)
    emb.load_state_dict(WeightOnlyLinear.from_float(torch.randn(40, 128), None, bits, group, sym).state_dict())
    h = torch.randn(1, 128)
    _tolerance_check(emb.project(h), h, emb.dequantized_weight(), None)


@pytest.mark.parametrize("bits", [4, 8])
def test_auto_takes_native_for_short_batches_only(built, bits):
    lin = WeightOnlyLinear.from_float(torch.randn(32, 64), None, bits, 32, True)
    limit = NATIVE_CHUNKED_ROWS[bits]
    assert limit > NATIVE_MAX_ROWS
    for rows in (1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, limit):
        assert lin.kernel_for(torch.randn(rows, 64)) == "native", rows
    assert lin.kernel_for(torch.randn(limit + 1, 64)) != "native"


@pytest.mark.parametrize("kernel", ["native", "native-q8a"])
def test_longer_batches_run_the_native_kernel_in_chunks(built, monkeypatch, kernel):
    """Beyond NATIVE_MAX_ROWS the kernel runs on chunks of that many rows: each row's result is the
    one the kernel gives its chunk alone, within fp32 rounding of the dequantized product, and
    no weight is dequantized on the way."""
    monkeypatch.setenv(KERNEL_ENV, kernel)
    lin = WeightOnlyLinear.from_float(torch.randn(40, 128), torch.randn(40), 4, 32, True)
    x = torch.randn(2 * NATIVE_MAX_ROWS + 3, 128)
    monkeypatch.setattr(lowbit, "dequantize", lambda *a, **k: pytest.fail("dequantized"))
    y = lin(x)
    q8 = kernel == "native-q8a"
    ops = (lin.weight, *lin.native_operands(), lin.bias, 4)
    chunks = [native_kernels.weight_only_linear(c, *ops, q8_activations=q8) for c in x.split(NATIVE_MAX_ROWS)]
    assert torch.equal(y, torch.cat(chunks))
    if not q8:
        monkeypatch.undo()
        _tolerance_check(y, x, lin._stored(torch.float32), lin.bias)


def test_off_and_missing_paths_are_one_line_errors(monkeypatch, built):
    lin = WeightOnlyLinear.from_float(torch.randn(32, 64), None, 8, 0, True)
    monkeypatch.setenv(native_kernels.ISA_ENV, "off")
    assert lin.kernel_for(torch.randn(1, 64)) != "native"  # auto: the built-in kernels
    monkeypatch.setenv(KERNEL_ENV, "native")
    with pytest.raises(UsageError, match=f"{KERNEL_ENV}=native: .*{native_kernels.ISA_ENV}=off"):
        lin(torch.randn(1, 64))
    monkeypatch.setenv(native_kernels.ISA_ENV, "sse")
    with pytest.raises(UsageError, match=native_kernels.ISA_ENV):
        lin(torch.randn(1, 64))
    if built != "avx512":  # a path beyond this CPU is refused, never run
        monkeypatch.setenv(native_kernels.ISA_ENV, "avx512")
        with pytest.raises(UsageError, match="runs at most"):
            lin(torch.randn(1, 64))


@pytest.mark.parametrize("cxx", ["/nonexistent/c++", "false"])
def test_a_failed_build_is_one_warning(monkeypatch, tmp_path, cxx):
    monkeypatch.setenv("CXX", cxx)
    with pytest.warns(RuntimeWarning, match="native CPU kernels are unavailable") as rec:
        why = native_kernels.load_library(tmp_path / "k")
    assert why and len(rec) == 1 and "\n" not in str(rec[0].message)
    assert not (tmp_path / "k" / f"{native_kernels._LIB}.so").exists()


@pytest.mark.slow
@pytest.mark.skipif(not native_kernels.OPENMP_FLAGS, reason="this torch does not use OpenMP")
def test_a_compiler_without_openmp_builds_serial_kernels(monkeypatch, tmp_path):
    """A compiler that rejects -fopenmp (clang without libomp) still gives working kernels, on one
    thread, with one warning saying how to get the threaded build."""
    cxx = tmp_path / "cxx"
    cxx.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && { echo "error: no OpenMP" >&2; exit 1; }; done\n'
                   f'exec {shutil.which("c++")} "$@"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    code = ("import torch, warnings; from gptforge.transforms import native_kernels as nk\n"
            "with warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n"
            f"    assert nk.load_library(__import__('pathlib').Path({str(tmp_path / 'k')!r})) is None\n"
            "torch.set_num_threads(2); print(nk.threads_used(64), [str(x.message) for x in w])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(Path(native_kernels.__file__).parents[2])})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("1 ") and "built without OpenMP" in r.stdout


def test_a_waiting_process_loads_the_library_the_lock_holder_built(built, tmp_path, capsys):
    """While one process holds the build lock, another waits, then finds the library and does not
    build it again."""
    done = native_kernels.build_dir() / f"{native_kernels._LIB}.so"
    d = tmp_path / "k"
    got = []
    with native_kernels._locked(d):
        t = threading.Thread(target=lambda: got.append(native_kernels._build(d)))
        t.start()
        t.join(0.5)
        assert t.is_alive()  # waiting on the lock
        shutil.copy(done, d / done.name)
    t.join(30)
    assert got == [d / done.name] and not (d / "build").exists()
    assert "building" not in capsys.readouterr().err


def test_a_build_killed_midway_does_not_block_the_next_one(monkeypatch, tmp_path):
    """A build killed midway (Ctrl-C, a timeout) leaves cpp_extension's lock file in the build
    directory; the next build (holding gptforge's own lock, released by the OS at the death) goes
    ahead instead of waiting on it forever."""
    d = tmp_path / "k"
    (d / "build").mkdir(parents=True)
    (d / "build" / "lock").touch()  # what a killed cpp_extension.load leaves
    seen = []

    def load(name, sources, build_directory, **_):
        seen.append((Path(build_directory) / "lock").exists())
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", load)
    done = []
    t = threading.Thread(target=lambda: done.append(native_kernels._build(d)), daemon=True)
    t.start()
    t.join(30)
    assert done == [d / f"{native_kernels._LIB}.so"] and seen == [False]


def test_a_new_process_reuses_the_built_library(built):
    code = ("import torch; from gptforge.transforms import native_kernels as nk; assert nk.unavailable() is None; "
            "print(nk.cpu_isa())")
    src = str(Path(native_kernels.__file__).parents[2])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": src})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == built and "building" not in r.stderr


# ----------------------------------------------------------------------- opt-in integer-dot variant


def _q8a_reference(x, q, s, z, group, bits):
    """The variant's definition in exact integers: x rounded per block of 32 (step max|x|/127, half
    to even), each block's integer dot product with q - zero, scaled by its step and the group's."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127.0  # fp32, as the kernel divides
    xq = torch.where(d[..., None] > 0, torch.round(xb / d[..., None].clamp_min(1e-38)), torch.zeros_like(xb))
    g = group or k
    zz = (z if z is not None else torch.zeros_like(s)).to(torch.int64).repeat_interleave(g, 1)
    qz = q.to(torch.int64) - zz  # [n, k]
    dots = torch.einsum("mbj,nbj->mnb", xq.to(torch.int64), qz.reshape(-1, k // 32, 32))  # exact integers
    sc = s.double().repeat_interleave(g // 32, 1)  # [n, blocks]
    return xq.to(torch.int8).reshape(m, k), d, (dots.double() * d.double()[:, None, :] * sc[None]).sum(-1)


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("bits,group,sym,k,n", [(8, 0, True, 96, 40), (8, 32, False, 128, 9), (4, 32, True, 128, 33),
                                                (4, 64, False, 192, 16), (4, 0, True, 64, 5)])
@pytest.mark.parametrize("rows", [1, 5])
def test_q8a_equals_its_integer_reference(built, path, bits, group, sym, k, n, rows):
    skip_unless_runs(path, built)
    w = torch.randn(n, k)
    q, s, z = lowbit.quantize_rtn(w, bits, group, sym)
    x = torch.randn(rows, k)
    x[0, :32] = 0  # an all-zero block: step 0
    zero = None if sym else z.to(torch.int8)
    xq, d, ref = _q8a_reference(x, q, s, zero, group, bits)
    got_q, got_d = native_kernels.quantize_q8a(x, path)
    assert torch.equal(got_q, xq) and torch.equal(got_d, d)
    b = torch.randn(n)
    y = native_kernels.weight_only_linear(x, lowbit.pack_int4(q) if bits == 4 else q, s, zero, b, bits, path,
                                          q8_activations=True)
    ref = ref + b.double()
    size = (xq.abs().double() * d.repeat_interleave(32, 1)) @ (q.abs().double() + 8).T * s.abs().max()
    assert bool(((y.double() - ref).abs() <= 1e-5 * ref.abs() + 2e-6 * size + 1e-7).all())


@pytest.mark.parametrize("path", ["avx2", "avx512"])
def test_q8a_rounding_is_the_scalar_paths_bit_for_bit(built, path):
    """The vector paths round the activations (vectorized) to the scalar loop's bits: ties (x / step
    exactly k + 1/2, to even), zero and -0 blocks, subnormals, and the non-finite values (a NaN
    rounds to 0 and is skipped by the block's maximum, an inf makes the step inf), in column
    order and in the int4 rows' order (each block as [even columns, odd columns])."""
    skip_unless_runs(path, built)
    x = torch.randn(4, 256)
    x[0, :32], x[0, 32:64] = 0.0, -0.0
    x[1, :32] = torch.tensor([127.0, -127.0] + [k + 0.5 for k in range(-15, 15)])  # step 1: every value a tie
    x[1, 32:64] *= 1e-40  # subnormal
    x[2, 5], x[2, 40], x[2, 70], x[2, 71] = float("nan"), float("inf"), float("-inf"), float("nan")
    for order in (False, True):
        want_q, want_d = native_kernels.quantize_q8a(x, "scalar", order)
        got_q, got_d = native_kernels.quantize_q8a(x, path, order)
        assert torch.equal(got_q, want_q) and torch.equal(got_d, want_d)
    plain, _ = native_kernels.quantize_q8a(x, path)
    j = torch.arange(32)
    assert torch.equal(got_q.view(4, 8, 32)[:, :, (j % 2) * 16 + j // 2], plain.view(4, 8, 32))
    assert torch.equal(plain[1, :32], torch.tensor([127, -127] + [2 * round((k + 0.5) / 2) for k in range(-15, 15)],
                                                  dtype=torch.int8))


def test_q8a_is_opt_in_and_needs_whole_blocks(monkeypatch, built):
    lin = WeightOnlyLinear.from_float(torch.randn(16, 64), None, 4, 32, True)
    assert lin.kernel_for(torch.randn(1, 64)) == "native"  # auto never rounds activations
    monkeypatch.setenv(KERNEL_ENV, "native-q8a")
    assert lin.kernel_for(torch.randn(1, 64)) == "native-q8a"
    odd = WeightOnlyLinear.from_float(torch.randn(16, 48), None, 8, 0, True)  # 48 columns: not whole blocks
    assert odd.kernel_for(torch.randn(1, 48)) == "native"
    x = torch.randn(2, 64)
    _, _, ref = _q8a_reference(x, lin.ints(), lin.weight_scale, None, 32, 4)
    torch.testing.assert_close(lin(x).double(), ref, rtol=1e-5, atol=1e-5)
