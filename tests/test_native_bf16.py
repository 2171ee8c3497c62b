"""gptforge's native CPU kernels for bf16 weights (`WeightOnlyLinear` bits 16,
`csrc/weight_only_gemv.cpp`): y = x · W.float()ᵀ + b with fp32 accumulation. A bf16 value widens
to fp32 exactly, so every instruction-set path (forced in turn; those this CPU cannot execute are
skipped) must equal the float64 product of `W.float()` within fp32 rounding, and every finite bf16
bit pattern must come through unchanged. The layers take this kernel for decode-sized batches on
any CPU (`kernel_for`)."""

from __future__ import annotations

import pytest
import torch

from gf_testutil import ISA_ORDER, skip_unless_runs, within_fp32_rounding
from gptforge.transforms import native_kernels
from gptforge.transforms.weight_only import (
    KERNEL_ENV,
    NATIVE_CHUNKED_ROWS,
    NATIVE_MAX_ROWS,
    WeightOnlyEmbedding,
    WeightOnlyLinear,
    native_bf16,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _bf16_weight(n: int, k: int) -> torch.Tensor:
    """Rows of different magnitudes, some columns far larger or smaller than the rest."""
    w = torch.randn(n, k) * torch.rand(n, 1) * torch.exp2(torch.randint(-8, 9, (1, k)).float())
    return w.to(torch.bfloat16)


# (in, out): whole vector steps (8 and 16 columns), odd widths (scalar tails), fewer columns
# than one vector, a single output.
SHAPES = [(96, 40), (37, 5), (300, 17), (7, 3), (16, 1)]


@pytest.mark.parametrize("path", ISA_ORDER)
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])  # the row-block sizes R = 4, 2, 1
@pytest.mark.parametrize("bias", [True, False])
def test_every_path_equals_the_float64_reference(built, path, k, n, rows, bias):
    skip_unless_runs(path, built)
    w = _bf16_weight(n, k)
    b = torch.randn(n) if bias else None
    x = torch.randn(rows, k)
    y = native_kernels.weight_only_linear(x, w, None, None, b, 16, path)
    within_fp32_rounding(y, x, w.float(), b)


@pytest.mark.parametrize("path", ISA_ORDER)
def test_every_finite_bf16_value_widens_exactly(built, path):
    """All 65280 finite bf16 bit patterns (zeros, subnormals, the largest), each picked out by a
    one-hot row of x: the output is the value itself, bit for bit."""
    skip_unless_runs(path, built)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    vals = bits.view(torch.bfloat16)
    vals = vals[torch.isfinite(vals.float())]
    assert vals.numel() == 65536 - 256
    w = vals.reshape(-1, 16)  # [4080, 16]: one vector step on AVX-512, two on AVX2
    eye = torch.eye(16)
    y = torch.cat([native_kernels.weight_only_linear(eye[i:i + 8], w, None, None, None, 16, path)
                   for i in (0, 8)])
    assert torch.equal(y, w.float().T)  # one value times 1, plus zeros: no rounding anywhere


@pytest.mark.parametrize("path", ISA_ORDER)
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_many_rows_on_two_threads(built, path, rows):
    """Enough outputs for the row blocks, their prefetching and the end of the matrix, split between
    two threads at boundaries that are not multiples of a block: the same bits as one thread."""
    skip_unless_runs(path, built)
    w, x, b = _bf16_weight(1003, 264), torch.randn(rows, 264), torch.randn(1003)
    before = torch.get_num_threads()
    ys = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            ys.append(native_kernels.weight_only_linear(x, w, None, None, b, 16, path))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ys[0], ys[1])  # one output is always one task's
    within_fp32_rounding(ys[0], x, w.float(), b)


def test_operands_are_checked(built):
    """The op refuses what would be read wrongly: scales or zeros with bf16, fp16 weights as bits 16."""
    w, x = _bf16_weight(8, 32), torch.randn(1, 32)
    with pytest.raises(RuntimeError, match="bf16 weights take no scale"):
        native_kernels.weight_only_linear(x, w, torch.ones(8, 1), None, None, 16)
    with pytest.raises(RuntimeError, match="bf16 weights take no zero"):
        native_kernels.weight_only_linear(x, w, None, torch.zeros(8, 1, dtype=torch.int8), None, 16)
    with pytest.raises(RuntimeError, match="bf16"):
        native_kernels.weight_only_linear(x, w.half(), None, None, None, 16)
    with pytest.raises(RuntimeError, match="need their scales"):
        native_kernels.weight_only_linear(x, torch.zeros(8, 32, dtype=torch.int8), None, None, None, 8)


def test_layers_take_native_for_decode_batches_on_any_cpu(built, monkeypatch):
    lin = WeightOnlyLinear.from_float(torch.randn(24, 64), torch.randn(24), 16, 0, True)
    assert lin.kernel_for(torch.randn(1, 64)) == "native"
    assert lin.kernel_for(torch.randn(NATIVE_MAX_ROWS, 64)) == "native"
    # oneDNN's bf16 beyond NATIVE_MAX_ROWS where native; elsewhere the kernel in chunks, then fp32
    longer = "bf16" if native_bf16() else "fp32"
    chunked = NATIVE_MAX_ROWS if native_bf16() else NATIVE_CHUNKED_ROWS[16]
    assert lin.kernel_for(torch.randn(chunked, 64)) == "native"
    assert lin.kernel_for(torch.randn(chunked + 1, 64)) == longer
    monkeypatch.setenv(KERNEL_ENV, "native-q8a")  # no int8 activations for bf16 weights: the exact kernel
    assert lin.kernel_for(torch.randn(1, 64)) == "native"
    monkeypatch.setenv(KERNEL_ENV, "fp32")
    assert lin.kernel_for(torch.randn(1, 64)) == "fp32"


@pytest.mark.parametrize("path", ISA_ORDER)
def test_a_layer_and_the_head_on_the_forced_path(built, monkeypatch, path):
    skip_unless_runs(path, built)
    monkeypatch.setenv(KERNEL_ENV, "native")
    monkeypatch.setenv(native_kernels.ISA_ENV, path)
    lin = WeightOnlyLinear.from_float(torch.randn(40, 72), torch.randn(40), 16, 0, True)
    x = torch.randn(2, 3, 72)
    assert lin.kernel_for(x.reshape(-1, 72)) == "native"
    within_fp32_rounding(lin(x).reshape(6, 40), x.reshape(6, 72), lin.weight.float(), lin.bias)
    emb = WeightOnlyEmbedding(50, 72, bits=16)
    emb.load_state_dict(WeightOnlyLinear.from_float(torch.randn(50, 72), None, 16, 0, True).state_dict())
    h = torch.randn(1, 72)
    assert emb.kernel_for(h) == "native"
    within_fp32_rounding(emb.project(h), h, emb.weight.float(), None)
    assert torch.equal(emb(torch.tensor([[3, 7]])), emb.weight[[3, 7]].float()[None])  # the lookup: exact
