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
    assert "hg" not in _vm_flags(big.data_ptr())


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
