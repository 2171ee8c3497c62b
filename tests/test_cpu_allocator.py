"""The CPU allocator's tuning (`device.tune_cpu_allocator`): freed blocks stay in the glibc heap, so
a step that allocates the same large buffers again does not page-fault them in again. The
trainer and the decode backend turn it on for CPU work; `GPTFORGE_MALLOC_TUNING=0` keeps glibc's
defaults. Each case runs in its own process (the setting is process-wide) and counts the minor
page faults of allocating and filling a 40 MB tensor (the median of 20 times): above glibc's
largest dynamic mmap threshold (32 MB), so without the tuning every one is a fresh mmap, faulted
in page by page."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                reason="mallopt tuning is glibc's (Linux)")

SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)

SCRIPT = """
import resource, sys
import torch
how = sys.argv[1]
if how == "call":
    from gptforge.device import tune_cpu_allocator
    print("tuned", tune_cpu_allocator())
elif how == "backend":
    from gf_testutil import tiny_model
    from gptforge.generate.backend import TorchBackend
    with TorchBackend(tiny_model()[0]):
        pass
counts = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(10 << 20).fill_(1.0)
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print("faults", sorted(counts)[10])
"""

PAGES = (40 << 20) // 4096  # one tensor's pages: what a fresh mmap faults in


def _thp_always() -> bool:
    """Transparent huge pages for every mapping: a fresh 40 MB mmap then faults in 2 MiB at a time."""
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


needs_small_pages = pytest.mark.skipif(_thp_always(), reason="transparent huge pages are on for every mapping: "
                                       "glibc's fresh mmaps fault in 2 MiB pages, not the 4 KiB ones counted")


def faults(how: str, tuning: str | None = None) -> tuple[int, str]:
    """The median number of minor page faults of one 40 MB allocation and fill, and the output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS])}
    env.pop("GPTFORGE_MALLOC_TUNING", None)
    if tuning is not None:
        env["GPTFORGE_MALLOC_TUNING"] = tuning
    out = subprocess.run([sys.executable, "-c", SCRIPT, how], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    return int(out.split("faults")[-1]), out


@needs_small_pages
def test_without_the_tuning_every_large_block_is_faulted_in_again():
    n, _ = faults("none")
    assert n > PAGES // 2, n  # the premise: glibc's default mmaps and unmaps each block


def test_the_tuning_keeps_freed_blocks_in_the_heap():
    n, out = faults("call")
    assert "tuned True" in out
    assert n < PAGES // 20, n


@needs_small_pages
def test_opening_a_cpu_decode_backend_tunes_the_allocator_unless_turned_off():
    n, _ = faults("backend")
    assert n < PAGES // 20, n
    off, _ = faults("backend", tuning="0")
    assert off > PAGES // 2, off
