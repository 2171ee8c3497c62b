"""`transforms/huge_pages.empty`: the buffers the fp32 GEMV streams are advised as transparent huge
pages (Linux) before they are written, and stay ordinary tensors wherever that is not possible."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gptforge.transforms import fp32_gemv, huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `addr`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return set()


@pytest.fixture(autouse=True)
def _fresh():
    huge_pages._madvise.cache_clear()  # the switch is read once per process: read it again here
    yield
    if hasattr(huge_pages._madvise, "cache_clear"):  # not while a test's stand-in is in place
        huge_pages._madvise.cache_clear()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists(), reason="no transparent huge pages")
def test_a_large_buffer_is_aligned_and_advised():
    t = huge_pages.empty((3, 1000, 1000))  # 12 MB
    assert t.shape == (3, 1000, 1000) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE == 0
    assert "hg" in _vm_flags(t.data_ptr())
    t.fill_(2.5)  # the whole buffer is writable and its own
    assert float(t.sum()) == 2.5 * t.numel()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_small_buffers_and_the_switch_leave_plain_tensors(monkeypatch):
    small = huge_pages.empty((100, 64), torch.bfloat16)
    assert small.shape == (100, 64) and small.dtype == torch.bfloat16
    monkeypatch.setenv(huge_pages.ENV, "off")
    huge_pages._madvise.cache_clear()
    big = huge_pages.empty((3, 1000, 1000))
    assert huge_pages._madvise() is None
    assert big.untyped_storage().nbytes() == big.numel() * 4  # a plain tensor: no aligned view into a larger buffer


def test_an_unknown_switch_value_is_a_usage_error(monkeypatch):
    from gptforge.errors import UsageError

    monkeypatch.setenv(huge_pages.ENV, "maybe")
    with pytest.raises(UsageError, match="GPTFORGE_HUGE_PAGES='maybe': choose one of auto, on, off"):
        huge_pages.empty((4, 1 << 20))


def test_a_failed_advice_gives_a_plain_buffer(monkeypatch):
    monkeypatch.setattr(huge_pages, "_madvise", lambda: (lambda *a: -1))
    t = huge_pages.empty((4, 1 << 20))
    assert t.shape == (4, 1 << 20)
    t.fill_(1.0)


def test_block_weight_on_huge_pages_keeps_the_layout():
    """The 64-output blocks (the last one zero-padded) whatever buffer they are written into."""
    w = torch.randn(50_000, 48)  # 9.6 MB of blocks: advised where possible; a partial last block
    b = fp32_gemv.block_weight(w)
    n = w.shape[0]
    ref = torch.zeros(-(-n // 64) * 64, 48)
    ref[:n] = w
    assert torch.equal(b, ref.view(-1, 64, 48).transpose(1, 2))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists(), reason="no transparent huge pages")
def test_rehome_moves_a_large_buffer_with_its_values():
    m = torch.nn.Module()
    m.register_buffer("weight", torch.randn(1200, 1000).to(torch.bfloat16)[:, 1:])  # 2.4 MB, not contiguous or aligned
    m.register_buffer("small", torch.randn(10, 10))
    before, small = m.weight.clone(), m.small
    huge_pages.rehome_(m, "weight")
    huge_pages.rehome_(m, "small")
    assert m.weight.data_ptr() % huge_pages.HUGE == 0 and "hg" in _vm_flags(m.weight.data_ptr())
    assert torch.equal(m.weight, before) and m.weight.dtype == torch.bfloat16 and "weight" in m.state_dict()
    assert m.small is small  # below one huge page: left alone
    moved = m.weight
    huge_pages.rehome_(m, "weight")
    assert m.weight is moved  # already there: no second copy
    huge_pages.rehome_(m, "missing")  # not a buffer: nothing to do


def test_the_backend_rehomes_weight_only_layers_when_it_opens(monkeypatch):
    """Every weight-only layer (the head included) is offered to `rehome_` when the decode backend
    opens, and decoding gives the same logits as without."""
    import copy

    from gf_testutil import tiny_model
    from gptforge.generate.backend import TorchBackend
    from gptforge.transforms.weight_only import WeightOnlyLinear, WeightOnlySpec, quantize_rtn_model

    torch.manual_seed(0)
    model = quantize_rtn_model(copy.deepcopy(tiny_model()[0]), WeightOnlySpec(bits=16, group_size=0, head_bits=16))
    layers = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
    seen = []
    real = huge_pages.rehome_
    monkeypatch.setattr(huge_pages, "rehome_", lambda mod, name: seen.append((mod, name)) or real(mod, name))
    ids = torch.randint(0, 500, (1, 7))
    with TorchBackend(model) as be:
        out = be.step(ids, torch.arange(7)[None], None, be.new_cache(1, 16))
    assert {id(m) for m, n in seen if n == "weight"} == {id(m) for m in layers} and len(layers) > 4
    monkeypatch.setattr(huge_pages, "rehome_", lambda mod, name: None)
    with TorchBackend(model) as be:
        assert torch.equal(be.step(ids, torch.arange(7)[None], None, be.new_cache(1, 16)), out)
