"""Shared fixtures. Tests make their own small data; nothing is downloaded."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

# Keep runs reproducible and light on the 2-core CI machine.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TOOL_DIRS = {".pytest_cache", ".ruff_cache", "__pycache__"}


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_in_the_checkout():
    """No test may leave files in the repository's top directory (a verb that writes to the
    working directory by default must run from a tmp_path there)."""
    before = set(os.listdir(_ROOT))
    yield
    left = sorted(set(os.listdir(_ROOT)) - before - _TOOL_DIRS)
    assert not left, f"tests left these in {_ROOT}: {left}"


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory):
    """gptforge's native CPU kernels build once per test session into its tmp directory (shared by
    xdist workers, who take turns on its lock), never into the user's ~/.cache."""
    saved = os.environ.get("GPTFORGE_KERNEL_CACHE")
    base = tmp_path_factory.getbasetemp()
    os.environ["GPTFORGE_KERNEL_CACHE"] = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)
                                              / "gptforge-kernels")
    yield
    if saved is None:
        os.environ.pop("GPTFORGE_KERNEL_CACHE", None)
    else:
        os.environ["GPTFORGE_KERNEL_CACHE"] = saved


@pytest.fixture
def built():
    """gptforge's native CPU kernels built (the weight-only products, the decode attention, the
    fp32 GEMV): the best instruction-set path this CPU runs. Skipped only where no C++ compiler
    exists (elsewhere a failed build fails the test)."""
    from gptforge.transforms import native_kernels

    why = native_kernels.unavailable()
    if why and not shutil.which("c++"):
        pytest.skip(f"no C++ compiler here: {why}")
    assert why is None, why
    return native_kernels.cpu_isa()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _automatic_kernel_choice(monkeypatch):
    """Tests see the automatic INT8 kernel choice even when the user's shell forces one (a forced
    inexact path would fail unrelated tests); tests of the forcing set the variables themselves."""
    for var in ("GPTFORGE_INT8_KERNEL", "GPTFORGE_ORT_INT8_GEMM", "GPTFORGE_WEIGHT_KERNEL", "GPTFORGE_NATIVE_ISA"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def run_cli(capsys):
    """Run `gptforge ...` in-process; returns (exit code, stdout, stderr)."""
    from gptforge.cli import main

    def _run(*argv: str):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse --help / usage errors
            code = e.code if isinstance(e.code, int) else 1
        out = capsys.readouterr()
        return code, out.out, out.err

    return _run


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and lose a lot to a busy CI machine
    (modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The two ONNX exports the export and infer tests share (`exported` makes each once per session).
@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    """(model dir, ONNX dir): the fp32 export of the pruned test model (test_export_support)."""
    from test_export_support import exported

    return exported(str(tmp_path_factory.getbasetemp()), "pruned")


@pytest.fixture(scope="module")
def int8(tmp_path_factory):
    """(model dir, ONNX dir): the INT8 QDQ export of the QAT test model (test_export_support)."""
    from test_export_support import exported

    return exported(str(tmp_path_factory.getbasetemp()), "qat")
