"""The decode backend's tanh GELU (`csrc/gelu.cpp`, `native_kernels.gelu_tanh`): within a few
float32 ulps of the exact function (computed in float64 without the cancellation of 1 + tanh),
the same bits on every instruction-set path and wherever an element sits, and routed by
`TorchBackend` while it is open (the fused batch-1 step runs it too, so both steps agree; with the
native kernels off, torch's GELU and no fused step)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gf_testutil import ISA_ORDER, skip_unless_runs, tiny_model
from gptforge.generate import fused_step
from gptforge.generate.backend import TorchBackend
from gptforge.transforms import native_kernels

EPS = torch.finfo(torch.float32).eps


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.cat([torch.linspace(-10, 12, 20001), 3 * torch.randn(5000, generator=g),
                      torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-3, 40.0, 1e4])])


def _exact(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), in float64."""
    xd = x.double()
    u = math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)
    return xd / (1 + torch.exp(-2 * u))


@pytest.mark.parametrize("path", ISA_ORDER)
def test_within_a_few_ulps_of_the_exact_function(built, path):
    skip_unless_runs(path, built)
    x = _inputs()
    y, ref = native_kernels.gelu_tanh(x, path).double(), _exact(x)
    err = (y - ref).abs()
    # u's rounding in float32 (a few ulps) moves exp(-2u) by 2|u| times as much: the bound grows with it
    u = math.sqrt(2 / math.pi) * (x.double() + 0.044715 * x.double() ** 3)
    ulps = err / (EPS * ref.abs().clamp_min(1e-30))
    assert bool((ulps <= 4 + 4 * u.abs())[x > -5].all()), float((ulps - 4 * u.abs())[x > -5].max())
    assert float(err[x <= -5].max()) < 1e-6  # where the value is below 2e-6 in magnitude: absolute
    assert torch.equal(torch.signbit(y[x < 0]), torch.ones_like(y[x < 0], dtype=torch.bool))
    aten = torch.nn.functional.gelu(x, approximate="tanh").double()
    torch.testing.assert_close(y[x > -3], aten[x > -3], rtol=4e-6, atol=1e-7)  # ATen's loses more below


@pytest.mark.parametrize("path", ISA_ORDER)
def test_same_bits_on_every_path_and_position(built, path):
    skip_unless_runs(path, built)
    x = _inputs()
    full = native_kernels.gelu_tanh(x, path)
    assert torch.equal(full, native_kernels.gelu_tanh(x, "scalar"))
    for start, n in ((0, 13), (5, 8), (3, 1), (1, 4099)):  # vector tails and offsets
        assert torch.equal(native_kernels.gelu_tanh(x[start:start + n].clone(), path), full[start:start + n])
    rows = x[:3 * 3072].view(3, 1, 3072)
    strided = rows.transpose(0, 2)  # not contiguous: read through a copy, same values
    assert torch.equal(native_kernels.gelu_tanh(strided, path), native_kernels.gelu_tanh(strided.contiguous(), path))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(native_kernels.gelu_tanh(x, path), full)
    finally:
        torch.set_num_threads(n)


def test_the_backend_routes_the_model_gelus_while_open(built):
    model = tiny_model()[0].eval()
    acts = [m for m in model.modules() if type(m) is nn.GELU]
    assert acts and all(a.approximate == "tanh" for a in acts)
    x = torch.randn(2, 5, 64, requires_grad=True)
    with TorchBackend(model) as backend:
        assert all(a.forward is native_kernels.gelu_forward for a in acts)
        assert torch.equal(acts[0](x.detach()), native_kernels.gelu_tanh(x.detach()))
        y = acts[0](x)  # autograd wants torch's own
        assert y.requires_grad and torch.equal(y, torch.nn.functional.gelu(x, approximate="tanh"))
        assert fused_step.build(model, backend._linear_ops) is not None
        acts[0].forward = lambda t: torch.nn.functional.gelu(t, approximate="tanh")  # someone else's GELU
        assert fused_step.build(model, backend._linear_ops) is None  # the fused step declines
        acts[0].forward = native_kernels.gelu_forward
    assert all("forward" not in a.__dict__ for a in acts)


def test_no_native_kernels_no_routing(built, monkeypatch):
    monkeypatch.setenv(native_kernels.ISA_ENV, "off")
    model = tiny_model()[0].eval()
    with TorchBackend(model) as backend:
        assert not any("forward" in m.__dict__ for m in model.modules() if type(m) is nn.GELU)
        assert fused_step.build(model, backend._linear_ops) is None
