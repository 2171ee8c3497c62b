"""One GEMV of GPT-2 124M's shapes: gptforge's native weight-only kernels vs fp32 `F.linear` and
PyTorch's packed int8 / int4 CPU kernels, and the batch size up to which `native` wins.

    .venv/bin/python benchmarks/lowbit_kernels.py                  # threads 1 and 2, 7 rounds
    .venv/bin/python benchmarks/lowbit_kernels.py --threads 1 --rounds 3 --rows 1 2 4 8 16

Shapes (in x out): 768x3072 (c_fc), 3072x768 (c_proj), 768x50257 (the LM head). Random weights
rounded to nearest; int8 one scale per row, int4 symmetric in groups of 64. Every kernel runs in
each round (interleaved: load from other processes hits all alike); reported: the median of the
per-round medians in microseconds and the weight bytes each streamed per microsecond (GB/s).
`native-q8a`: the opt-in variant with int8 activations (integer dot products). A bandwidth probe (the sum of a 256 MB fp32 tensor, read once per call) bounds what streaming
weights can reach; the int4 "weight-streaming limit" of a decode step is its bytes over that.
`--rows`: the same kernels at batch M (`native` vs the path `auto` takes above it).
`--baseline DIR`: another checkout's kernel sources (e.g. main's `src/gptforge/transforms/csrc`),
built once into a temporary directory under a renamed op namespace and timed as `baseline native
...` in the same rounds (before/after in one process); every baseline kernel's output must equal
this checkout's bit for bit (`torch.equal`, checked before timing: the run stops where one differs);
with `--baseline-rounding` (a change that sums in another order) within fp32 rounding instead.
`--shapes 768x2304 768x768`: other (in x out) shapes; `--cold MB`: each call reads the next of
enough copies of the weights to fill MB (larger than the last-level cache: the weights stream from
memory, as in a whole decode step, instead of staying in the caches between calls).
`int8 g64`: int8 in groups of 64 (the tied head of `lowbit_decode.py`'s int4 model).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_speed import cpu_name  # noqa: E402 - the shared CPU line

SHAPES = [(768, 3072), (3072, 768), (768, 50257)]
COLD_MB = [0]  # --cold
BASELINE_NS = "gptforge_wo_baseline"
_BASELINE: list = []  # the baseline's op namespace, once built


def load_baseline(src: str) -> None:
    """Build the kernel sources in `src` under the op namespace BASELINE_NS and load them."""
    from torch.utils import cpp_extension

    from gptforge.transforms.native_kernels import CFLAGS, SOURCES

    d = Path(tempfile.mkdtemp(prefix="gf-baseline-kernels-"))
    for f in Path(src).iterdir():
        if f.is_file():
            text = f.read_text().replace("TORCH_LIBRARY(gptforge_wo,", f"TORCH_LIBRARY({BASELINE_NS},")
            (d / f.name).write_text(text.replace("TORCH_LIBRARY_FRAGMENT(gptforge_wo,",
                                                 f"TORCH_LIBRARY_FRAGMENT({BASELINE_NS},"))
    try:
        cpp_extension.load(BASELINE_NS, [str(d / s) for s in SOURCES if (d / s).is_file()], extra_cflags=list(CFLAGS),
                           build_directory=str(d), is_python_module=False, verbose=False)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    _BASELINE.append(getattr(torch.ops, BASELINE_NS))


CLOCK = [time.perf_counter]  # --cpu-time at one thread: time.thread_time (not the time others hold the core)


def _time(f, reps: int) -> float:
    clock = CLOCK[0]
    ts = []
    for _ in range(reps):
        t = clock()
        f()
        ts.append(clock() - t)
    return statistics.median(ts)


def _rotating(tensors: list[torch.Tensor]):
    """A callable returning the next of `tensors` on each call (one copy: always that one)."""
    state = [0]

    def nxt() -> tuple:
        state[0] = (state[0] + 1) % len(tensors)
        return tensors[state[0]]
    return nxt


def _copies(nbytes: int) -> int:
    """How many copies of `nbytes` of weights fill --cold MB (1 when warm)."""
    return max(2, -(-COLD_MB[0] * 2**20 // nbytes)) if COLD_MB[0] else 1


def kernels(k: int, n: int, rows: int) -> dict[str, tuple[object, int]]:
    """{name: (callable, weight bytes)} for one shape at batch `rows`."""
    from gptforge.transforms import lowbit, native_kernels
    from gptforge.transforms.cpu_kernels import fbgemm_available, fbgemm_prepack

    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    x = torch.randn(rows, k)
    q8, s8, _ = lowbit.quantize_rtn(w, 8, 0, True)
    q8g, s8g, _ = lowbit.quantize_rtn(w, 8, 64, True)
    q4, s4, _ = lowbit.quantize_rtn(w, 4, 64, True)
    p4 = lowbit.pack_int4(q4)
    out: dict[str, tuple[object, int]] = {"fp32 F.linear": (lambda: F.linear(x, w), w.numel() * 4)}
    out["aten int8pack"] = (lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8[:, 0]), q8.numel() + 4 * n)
    if n % 16 == 0:  # the packed int4 kernel needs rows in multiples of 16 (the head's 50257 has not)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q4.int() + 8), 1)
        qsz = torch.stack([s4.t(), torch.zeros_like(s4).t()], -1).contiguous()
        out["aten int4pack g64"] = (lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 64, qsz),
                                    p4.numel() + 8 * s4.numel())
    if rows <= native_kernels.max_rows():
        code = native_kernels.ISA_CODES[native_kernels.isa()]
        ops = {"native": torch.ops.gptforge_wo.linear, "native-q8a": torch.ops.gptforge_wo.linear_q8a}
        if _BASELINE:
            ops.update({"baseline native": _BASELINE[0].linear, "baseline native-q8a": _BASELINE[0].linear_q8a})
        for fmt, (wq, sq, bits) in {"int8": (q8, s8, 8), "int8 g64": (q8g, s8g, 8), "int4 g64": (p4, s4, 4)}.items():
            nbytes = wq.numel() + 4 * sq.numel()
            nxt = _rotating([(wq.clone(), sq.clone()) for _ in range(_copies(nbytes))])
            for tag, op in ops.items():
                out[f"{tag} {fmt}"] = (lambda op=op, nxt=nxt, bits=bits: op(x, *nxt(), None, None, bits, code),
                                       nbytes)
    if fbgemm_available():  # the real INT8 model's path: `split` rows (2 per row; the head's 2 digits: 4)
        op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
        pk = fbgemm_prepack(q8, s8[:, 0])
        xs = torch.cat([x, -x] * (2 if n > 4 * k else 1))
        out["fbgemm int8 (INT8 model)"] = (lambda: op(xs, 0.01, 0, pk), q8.numel() + 4 * n)
    deq8 = lambda: F.linear(x, lowbit.dequantize(q8, s8, torch.zeros_like(s8), 0))  # noqa: E731
    out["fp32 dequant int8"] = (deq8, q8.numel() + 4 * n)
    return out


BASELINE_ROUNDING = [False]  # --baseline-rounding


def check_baseline(suite: dict[str, tuple[object, int]], shape: tuple[int, int]) -> None:
    """Every `baseline X` kernel's output equals `X`'s bit for bit, or within fp32 rounding with
    --baseline-rounding (SystemExit naming it if not)."""
    for name, (f, _) in suite.items():
        if name.startswith("baseline "):
            mine, base = suite[name.removeprefix("baseline ")][0](), f()
            same = (torch.allclose(mine, base, rtol=1e-5, atol=1e-5 * float(base.abs().max()))
                    if BASELINE_ROUNDING[0] else torch.equal(mine, base))
            if not same:
                raise SystemExit(f"{shape[0]}x{shape[1]} {name.removeprefix('baseline ')}: output differs from the "
                                 f"baseline's (max |diff| {float((mine - base).abs().max()):.3g})")


def bandwidth_gbs(reps: int = 9) -> float:
    """GB/s of reading a 256 MB fp32 tensor once (a sum), at torch's thread count."""
    big = torch.ones(64 * 2**20)
    big.sum()
    return big.numel() * 4 / _time(lambda: big.sum(), reps) / 1e9


ONLY: list[str] = []


def table(threads: int, rows: int, rounds: int, reps: int) -> None:
    torch.set_num_threads(threads)
    suites = {shape: {k: v for k, v in kernels(*shape, rows).items()
                      if not ONLY or k == "fp32 F.linear" or any(o in k for o in ONLY)} for shape in SHAPES}
    for shape, suite in suites.items():
        check_baseline(suite, shape)
    per: dict[tuple, list[float]] = {}
    for _ in range(rounds):
        for shape, ks in suites.items():
            for name, (f, _) in ks.items():
                f()
                per.setdefault((shape, name), []).append(_time(f, reps))
    bw = bandwidth_gbs()
    clock = "thread CPU time" if CLOCK[0] is time.thread_time else "wall time"
    print(f"\n### {threads} thread(s), batch {rows}, {clock}: median of {rounds} interleaved rounds x {reps} calls; "
          f"bandwidth probe {bw:.1f} GB/s; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}\n")
    print("| shape (in x out) | kernel | us | GB/s of weights | vs fp32 F.linear | baseline's time / this |")
    print("|---|---|---:|---:|---:|---:|")
    for shape, ks in suites.items():
        base = statistics.median(per[(shape, "fp32 F.linear")])
        for name, (_, nbytes) in ks.items():
            t = statistics.median(per[(shape, name)])
            b = per.get((shape, f"baseline {name}"))
            vs = f"{statistics.median(b) / t:.2f}x" if b else ""
            print(f"| {shape[0]}x{shape[1]} | {name} | {t * 1e6:.0f} | {nbytes / t / 1e9:.1f} | {base / t:.2f}x | {vs} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="batch sizes M")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=15, help="calls per kernel per round")
    ap.add_argument("--baseline", metavar="DIR", help="another checkout's csrc/ to time alongside (see above)")
    ap.add_argument("--baseline-rounding", action="store_true",
                    help="the baseline's outputs may differ within fp32 rounding (another summation order)")
    ap.add_argument("--only", nargs="*", default=None, help="only kernels whose name contains one of these")
    ap.add_argument("--cpu-time", action="store_true", help="at 1 thread, time the calling thread's CPU time")
    ap.add_argument("--shapes", nargs="+", metavar="INxOUT", help="(in x out) shapes instead of the default three")
    ap.add_argument("--cold", type=int, default=0, metavar="MB", help="rotate copies of the weights filling MB")
    args = ap.parse_args()
    if args.shapes:
        SHAPES[:] = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    COLD_MB[0] = args.cold
    from gptforge.transforms import native_kernels

    why = native_kernels.unavailable()
    if why:
        print(f"gptforge's native kernels are unavailable: {why}")
        return 2
    BASELINE_ROUNDING[0] = args.baseline_rounding
    if args.baseline:
        load_baseline(args.baseline)
    ONLY[:] = args.only or []
    print(f"machine: {cpu_name()}; native path {native_kernels.isa()}; torch {torch.__version__}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for threads in args.threads:
        CLOCK[0] = time.thread_time if args.cpu_time and threads == 1 else time.perf_counter
        for rows in args.rows:
            table(threads, rows, args.rounds, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
