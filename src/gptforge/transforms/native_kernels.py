"""gptforge's own CPU kernels (`csrc/`): built once per torch version and source, on first use.

The library is compiled with `torch.utils.cpp_extension` (a C++ compiler and ninja needed) into
`$GPTFORGE_KERNEL_CACHE`, else `$GPTFORGE_CACHE/kernels`, else ~/.cache/gptforge/kernels, in a
directory named by the torch version and a hash of the sources and flags, so an upgrade or an
edit builds afresh and nothing stale is loaded. A file lock keeps two processes from building
the same directory at once (the second waits, then loads the first one's library). Without a
compiler, or when the build fails, one warning line and the callers' other kernels.

The sources are never compiled with -march=native (a cache directory can be shared between
CPUs): each instruction-set path is a function with its own target attribute and one is chosen
at run time from cpuid. `GPTFORGE_NATIVE_ISA` picks it: `auto` (the best this CPU has),
`avx512`, `avx2`, `scalar` (portable C++), or `off` (never build or use the native kernels).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import warnings
from pathlib import Path

import torch

from gptforge.errors import UsageError
from gptforge.transforms.cpu_kernels import requested_choice

ISA_ENV = "GPTFORGE_NATIVE_ISA"
ISAS = ("auto", "avx512", "avx2", "scalar", "off")
ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2}
CACHE_ENV = "GPTFORGE_KERNEL_CACHE"
SOURCES = ("weight_only_gemv.cpp", "weight_only_q8a.cpp", "decode_attention.cpp", "fp32_gemv.cpp", "fused_decode.cpp",
           "int8_rows.cpp", "row_argmax.cpp", "gelu.cpp", "head_screen.cpp")
# -fopenmp: at::parallel_for is an inline template that runs serially unless the extension itself is
# compiled with OpenMP (_OPENMP); its GOMP symbols resolve to torch's own runtime, one thread pool.
OPENMP_FLAGS = ("-fopenmp",) if torch._C.has_openmp else ()
CFLAGS = ("-O3", "-std=c++17", "-fno-math-errno", *OPENMP_FLAGS)
_CSRC = Path(__file__).resolve().parent / "csrc"
_LIB = "gptforge_wo"


def cache_root() -> Path:
    """Where built kernels live (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("GPTFORGE_CACHE") or Path.home() / ".cache" / "gptforge"
    return Path(base) / "kernels"


def build_dir() -> Path:
    """This torch version's and these sources' build directory."""
    h = hashlib.sha256(" ".join(CFLAGS).encode())
    for f in sorted(_CSRC.iterdir()):  # the sources and their headers
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return cache_root() / f"torch{torch.__version__.replace('+', '_')}-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _locked(d: Path):
    """An exclusive lock on `d`/build.lock (released by the OS if the holder dies)."""
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(d: Path) -> Path:
    """The library in `d`, compiled there first if absent (under the lock)."""
    lib = d / f"{_LIB}.so"
    if lib.is_file():
        return lib
    with _locked(d):
        if lib.is_file():  # another process built it while we waited
            return lib
        from torch.utils import cpp_extension

        from gptforge import progress

        if not shutil.which(os.environ.get("CXX", "c++")):
            raise RuntimeError("no C++ compiler (c++) on PATH")
        progress.info("building CPU kernels (once)")
        tmp = d / "build"
        tmp.mkdir(exist_ok=True)
        with progress.task("building CPU kernels"):
            try:
                _compile(cpp_extension, tmp, CFLAGS)
            except Exception:  # noqa: BLE001 - e.g. clang without libomp: retried without OpenMP below
                if not OPENMP_FLAGS:
                    raise
                tmp = d / "build-serial"
                tmp.mkdir(exist_ok=True)
                _compile(cpp_extension, tmp, tuple(f for f in CFLAGS if f not in OPENMP_FLAGS))
                warnings.warn("gptforge's CPU kernels were built without OpenMP (the compiler has none): they run "
                              "on one thread; install the compiler's OpenMP (e.g. libomp-dev for clang) and "
                              f"delete {d} to rebuild", RuntimeWarning, stacklevel=3)
        # cpp_extension names a second build of one name in a process `<name>_v1.so`
        built = max(tmp.glob(f"{_LIB}*.so"), key=lambda f: f.stat().st_mtime)
        os.replace(built, lib)  # atomic: a reader sees the whole library or none
        return lib


def _compile(cpp_extension, tmp: Path, flags: tuple[str, ...]) -> None:
    # cpp_extension's own lock file ("baton") stays behind when a build is killed (Ctrl-C, a
    # timeout), and every later build would wait on it forever; we hold `_locked` here, so no
    # other build of this directory is running and the file can only be stale.
    (tmp / "lock").unlink(missing_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpp_extension.load(_LIB, [str(_CSRC / s) for s in SOURCES], extra_cflags=list(flags),
                           build_directory=str(tmp), is_python_module=False, verbose=False)


@functools.lru_cache(maxsize=1)
def _load() -> str | None:
    """None once the library is loaded, else why not (one warning line, once per process)."""
    if hasattr(torch.ops, _LIB) and hasattr(getattr(torch.ops, _LIB), "linear"):
        return None
    return load_library(build_dir())


def load_library(d: Path) -> str | None:
    """Build (if needed) and load the library in directory `d`: None, or why it failed (warned)."""
    try:
        torch.ops.load_library(str(_build(d)))
        return None
    except Exception as e:  # noqa: BLE001 - any build failure means: use the other kernels
        lines = str(e).splitlines()
        why = next((ln for ln in lines if "error:" in ln), lines[0] if lines else type(e).__name__)
        why = " ".join(why.split())[:300]
        warnings.warn(f"gptforge's native CPU kernels are unavailable ({why}); using the built-in kernels",
                      RuntimeWarning, stacklevel=3)
        return why


def requested_isa() -> str:
    return requested_choice(None, ISA_ENV, ISAS, ISA_ENV)


def unavailable() -> str | None:
    """Why the native kernels cannot run here (None when they can); builds them on first call."""
    if requested_isa() == "off":
        return f"{ISA_ENV}=off"
    return _load()


@functools.lru_cache(maxsize=1)
def cpu_isa() -> str:
    """The best path this CPU runs (cpuid): `avx512`, `avx2` or `scalar`."""
    code = int(getattr(torch.ops, _LIB).cpu_isa())
    return {v: k for k, v in ISA_CODES.items()}[code]


def isa() -> str:
    """The path the kernels take: $GPTFORGE_NATIVE_ISA, else the CPU's best. UsageError where the
    variable asks for one this CPU lacks (it would crash on an illegal instruction)."""
    return _isa(os.environ.get(ISA_ENV))


@functools.lru_cache(maxsize=8)
def _isa(_env: str | None) -> str:
    req, best = requested_isa(), cpu_isa()
    if req == "auto":
        return best
    order = ("scalar", "avx2", "avx512")
    if order.index(req) > order.index(best):
        raise UsageError(f"{ISA_ENV}={req}: this CPU runs at most {best}; choose {best}, a lower one, or auto")
    return req


@functools.lru_cache(maxsize=1)
def max_rows() -> int:
    return int(getattr(torch.ops, _LIB).max_rows())


def weight_only_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                       bias: torch.Tensor | None, bits: int, path: str | None = None,
                       q8_activations: bool = False) -> torch.Tensor:
    """x [M, K] fp32 (M <= max_rows()) times the weight-only matrix (int8 [N, K] or packed int4
    [N, K/2] with scale [N, groups] and int8 zero or None; or bf16 [N, K], bits 16, scale and
    zero None) transposed, plus bias: [M, N] fp32. `q8_activations`: the opt-in integer-dot
    variant for int8 / int4 (x rounded to int8 per block of 32 columns, `quantize_q8a`; groups of
    a multiple of 32 columns)."""
    return _linear_op(q8_activations)(x.contiguous(), w, scale, zero, bias, bits, ISA_CODES[path or isa()])


def threads_used(tasks: int = 64) -> int:
    """How many threads the kernels' parallel loops run on now (torch.get_num_threads() when built
    with torch's OpenMP; 1 if the build lost it). The caller has checked `unavailable()`."""
    return int(getattr(torch.ops, _LIB).threads_used(tasks))


@functools.lru_cache(maxsize=2)
def _linear_op(q8_activations: bool):
    """The op object (looked up once: a decode step makes ~50 calls, each lookup costs microseconds)."""
    return getattr(torch.ops, _LIB).linear_q8a if q8_activations else getattr(torch.ops, _LIB).linear


def quantize_q8a(x: torch.Tensor, path: str | None = None,
                 int4_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The activations the integer-dot variant multiplies: (int8 [M, K], step [M, K/32]), rounded
    on `path` (as in `weight_only_linear`); `int4_order`: each block of 32 as [even columns, odd
    columns], the order the int4 vector rows read."""
    return tuple(getattr(torch.ops, _LIB).quantize_q8a(x.contiguous(), ISA_CODES[path or isa()], int4_order))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots, layer: int, starts: list[int],
                     path: str | None = None) -> torch.Tensor:
    """One new token per sequence: store row r's key/value ([R, heads, head_dim] fp32; rows and
    heads may be strided views, read in place) in `slots[r]` (a float32 or int8 `KVCache` of batch
    1; its `layer`) at position `starts[r]`, then attend over its positions 0..starts[r] (scale
    1/sqrt(head_dim)): [R, heads, head_dim], contiguous. The caller has
    checked `unavailable()`; `path` as in `weight_only_linear` (AVX-512 CPUs take the AVX2 path)."""
    keys = [s.k[layer] for s in slots]
    values = [s.v[layer] for s in slots]
    int8 = slots[0].k_scale is not None
    ks = [s.k_scale[layer] for s in slots] if int8 else []
    vs = [s.v_scale[layer] for s in slots] if int8 else []
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return getattr(torch.ops, _LIB).decode_attention(q, k, v, keys, values, ks, vs, starts, q.shape[-1] ** -0.5,
                                                     ISA_CODES[path or isa()])


def gelu_tanh(x: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """GELU with the tanh approximation of fp32 `x` (csrc/gelu.cpp: within a few ulps of
    the exact function, the same bits on every path and wherever an element sits). The caller has
    checked `unavailable()`; `path` as in `weight_only_linear`."""
    return getattr(torch.ops, _LIB).gelu_tanh(x, ISA_CODES[path or isa()])


def gelu_forward(x: torch.Tensor) -> torch.Tensor:
    """An `nn.GELU(approximate="tanh")`'s forward on `gelu_tanh` (what a decode backend routes the
    model's GELUs through while it is open): fp32 CPU input outside autograd; anything else
    through torch's own."""
    if x.dtype is torch.float32 and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled()):
        return gelu_tanh(x)
    return torch.nn.functional.gelu(x, approximate="tanh")


def fp32_gemv(x: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None, n: int, path: str | None = None) -> torch.Tensor:
    """One fp32 row x (numel K, last dim K) times the weight in 64-output blocks `wb` ([ceil(n/64), K, 64],
    `transforms/fp32_gemv.block_weight`), plus bias: x's shape with n outputs, each summed in one fixed
    order (csrc/fp32_gemv.cpp: oneDNN's packed kernel's on the AVX2 CPUs measured). The caller has checked
    `unavailable()`."""
    return getattr(torch.ops, _LIB).fp32_gemv(wb, x.contiguous(), bias, n, ISA_CODES[path or isa()])


def fp32_rows(x: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None, n: int, path: str | None = None) -> torch.Tensor:
    """`fp32_gemv` for x [rows, K]: [rows, n], each row's bits those `fp32_gemv` gives it alone (the
    rows share each weight block's loads; csrc/fp32_gemv.cpp). The caller has checked `unavailable()`."""
    return getattr(torch.ops, _LIB).fp32_rows(wb, x.contiguous(), bias, n, ISA_CODES[path or isa()])


def fp32_columns(x: torch.Tensor, w: torch.Tensor, cols: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """x [R, K] times the row-major fp32 weight's rows `cols` (int64 [C]): [R, C], each value the
    one `fp32_gemv` / `fp32_rows` give for that output over blocks made of `w` (csrc/fp32_gemv.cpp)."""
    return getattr(torch.ops, _LIB).fp32_columns(w, x.contiguous(), cols, ISA_CODES[path or isa()])


def screen_candidates(approx: torch.Tensor, floor: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """The columns (int64, ascending) where some row r of `approx` [R, V] is >= floor[r]
    (csrc/head_screen.cpp)."""
    return getattr(torch.ops, _LIB).screen_candidates(approx, floor, ISA_CODES[path or isa()])


def row_argmax(x: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """`x.argmax(dim=-1)` of fp32 scores [R, V] (the first maximum; a NaN counts as the maximum):
    int64 [R] (csrc/row_argmax.cpp). The caller has checked `unavailable()`."""
    return _argmax_op()(x.contiguous(), ISA_CODES[path or isa()])


@functools.lru_cache(maxsize=1)
def _argmax_op():
    return getattr(torch.ops, _LIB).row_argmax


def int8_rows(x: torch.Tensor, panels: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, step: float,
              n: int, path: str | None = None, qmax: int = 127) -> torch.Tensor:
    """x [rows, K] fp32 rounded to integers of `step` (nearest, ties to even, clamped to ±qmax <=
    32767) times the int8 weight in `panels` (`transforms/int8.pack_panels`) transposed, summed
    exactly in int32 (above qmax 127: per chunk of inputs, the chunks added as floats), then
    scaled by float(step)·w_scale (+ bias): [rows, n] (csrc/int8_rows.cpp). AVX-512 CPUs take the
    AVX2 path. The caller has checked `unavailable()`."""
    code = min(ISA_CODES[path or isa()], ISA_CODES["avx2"])
    return getattr(torch.ops, _LIB).int8_rows(x.contiguous(), panels, w_scale, bias, float(step), n, qmax, code)
