"""Where one fp32 decode step of the GPT-2 124M shape spends its time (issues #30 / #32).

    PYTHONPATH=src .venv/bin/python benchmarks/decode_profile.py [--threads 1,2] [--batches 1,8]
    PYTHONPATH=src .venv/bin/python benchmarks/decode_profile.py --time-only --rounds 5
    PYTHONPATH=src .venv/bin/python benchmarks/decode_profile.py --int8 --time-only --loops engine --batches 64

Random weights of the 124M shape (GPT-2's vocabulary, padded to 50304 rows like a trained
model). Two loops are measured, at every thread count and batch size asked for:

- `step`: `TorchBackend.step` over a `KVCache` (what `benchmarks/lowbit_decode.py` times; batch 1);
- `engine`: one `EngineCore.step` of the offline engine that `generate` / `infer` / `serve` run
  (ragged step over per-sequence slots + sampler + output processor), greedy, EOS suppressed.

For each: milliseconds per decode step (median of `--steps` steps after a 128-token prompt), the
same step's matrix products alone (every packed block Linear and the head called back to back on
one row per sequence: the weight-streaming part), the difference (everything else), and, unless
`--time-only`, a `torch.profiler` table (ops by self CPU time) with the number of ATen ops a step
dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_speed import cpu_name  # noqa: E402 - the shared CPU line

PROMPT = 128


def build(seed: int = 0):
    from gptforge.config import load_config
    from gptforge.model import build_model

    cfg = load_config(overrides=["Model.preset=124M", "Data.tokenizer=gpt2", "Model.hidden_dropout_prob=0",
                                 "Model.attention_probs_dropout_prob=0"])
    torch.manual_seed(seed)
    return build_model(cfg.Model).eval()


class StepLoop:
    """Batch-1 `TorchBackend.step` decoding over a `KVCache` (greedy)."""

    def __init__(self, backend, steps: int):
        self.be = backend
        self.cache = backend.new_cache(1, PROMPT + steps + 8)
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, 50257, (1, PROMPT), generator=g)
        logits = backend.step(prompt, torch.arange(PROMPT)[None], None, self.cache)
        self.tok = logits.argmax(-1, keepdim=True)

    def __call__(self) -> None:
        n = self.cache.length
        logits = self.be.step(self.tok, torch.tensor([[n]]), None, self.cache)
        self.tok = logits.argmax(-1, keepdim=True)


class EngineLoop:
    """Offline-engine decode steps of `batch` greedy sequences (prefill done before timing), of
    random prompts of PROMPT tokens or of the given `prompt` (token ids) each."""

    def __init__(self, backend, batch: int, steps: int, prompt: list[int] | None = None):
        from gptforge.generate.engine.offline import offline_engine
        from gptforge.generate.engine.params import SamplingParams
        from gptforge.generate.engine.sequence import Request

        self.core = offline_engine(backend, eos_token_ids=[50256], vocab_limit=50257, max_batch_size=batch)
        g = torch.Generator().manual_seed(1)
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, min_tokens=steps + 8)
        for _ in range(batch):
            ids = prompt if prompt is not None else torch.randint(0, 50256, (PROMPT,), generator=g).tolist()
            # Nobody reads scores here, as `gptforge generate` streaming text (greedy: the head may be screened).
            self.core.add(Request([ids], params, keep_scores=False), bounded=False)
        while any(s.chunks for s in self.core.scheduler.running) or self.core.scheduler.waiting:
            self.core.step()

    def __call__(self) -> None:
        self.core.step()


def matmul_only(model, backend, rows: int):
    """One step's matrix products alone, as the backend routes them (its patched Linears: the
    native products or oneDNN's packed copies; the head's GEMV blocks or packed copy)."""
    from gptforge.generate.backend import _native_product

    lins = [(m, torch.randn(rows, m.in_features)) for m in backend._linear_ops]
    h = torch.randn(rows, model.config.hidden_size)
    vocab = model.wte.weight.shape[0]

    def run():
        for m, x in lins:
            m(x)
        if backend._head_gemv is not None:
            _native_product(h, backend._head_gemv, None, vocab)
        else:
            torch.ops.mkldnn._linear_pointwise(h, backend._head, None, "none", [], "")
    return run


def median_ms(fn, n: int) -> tuple[float, float]:
    """(wall, CPU) milliseconds per call, medians of `n` calls. The CPU time is the calling
    thread's (`time.thread_time`): at one thread it is the whole step's, and it does not count
    the time other processes hold the core, which wall time on a shared machine does."""
    fn()
    wall, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def profile(fn, n: int, rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(n):
            fn()
    avg = prof.key_averages()
    top = sum(1 for e in prof.events() if e.key.startswith("aten::") and e.cpu_parent is None)
    ops = top / n
    print(f"  ATen ops dispatched per step (top level): {ops:.0f}")
    print(avg.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))
    shaped = prof.key_averages(group_by_input_shape=True)
    print(shaped.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40,
                       max_shapes_column_width=60))


def case(model, kind: str, batch: int, args) -> None:
    from gptforge.generate.backend import TorchBackend

    with TorchBackend(model, kv_cache_dtype="int8" if args.int8 else "auto") as be:
        total = args.steps * (args.rounds + 2) + 8
        loop = StepLoop(be, total) if kind == "step" else EngineLoop(be, batch, total)
        step, step_cpu = median_ms(loop, args.steps)
        # the real INT8 model has no packed fp32 Linears to time alone
        mm, mm_cpu = (0.0, 0.0) if args.int8 else median_ms(matmul_only(model, be, batch), args.steps)
        print(f"{kind} batch {batch}, {torch.get_num_threads()} threads: wall {step:.2f} ms/step (matmuls alone "
              f"{mm:.2f}); calling thread's CPU {step_cpu:.2f} ms/step (matmuls alone {mm_cpu:.2f}, other "
              f"{step_cpu - mm_cpu:.2f} = {(step_cpu - mm_cpu) / step_cpu:.0%}); load {os.getloadavg()[0]:.2f}",
              flush=True)
        if not args.time_only:
            profile(loop, args.profile_steps, args.rows)


def _set_tree(mods: dict | None, src: str | None = None) -> dict:
    """Make `mods` (a snapshot of `sys.modules`' gptforge entries) the imported gptforge, or
    with `src` start a fresh import from that source directory; returns the previous snapshot."""
    old = {k: m for k, m in sys.modules.items() if k == "gptforge" or k.startswith("gptforge.")}
    for k in old:
        del sys.modules[k]
    sys.path[:] = [p for p in sys.path if p not in TREES]
    if mods:
        sys.modules.update(mods)
    if src:
        sys.path.insert(0, src)
        TREES.add(src)
        importlib.import_module("gptforge")
    return old


TREES: set[str] = set()


def compare(args) -> None:
    """Two source trees in one process, their decode steps alternated one by one (see --compare)."""
    named = [("this tree", str(Path(__file__).resolve().parents[1] / "src")), ("other tree", args.compare)]
    if args.compare_first:
        named.reverse()
    trees = []
    for name, src in named:
        _set_tree(None, src)
        from gptforge.generate.backend import TorchBackend

        model = build()
        be = TorchBackend(model).__enter__()
        total = args.steps + 8
        loops = {("step", 1): StepLoop(be, total)} if "step" in args.loops else {}
        if "engine" in args.loops:
            loops.update({("engine", b): EngineLoop(be, b, total) for b in map(int, args.batches.split(","))})
        mods = _set_tree(None)
        trees.append((name, src, mods, loops))
    print("trees: " + "; ".join(f"{n} = {s}" for n, s, _, _ in trees))
    for key in trees[0][3]:
        cpu: dict[str, list[float]] = {n: [] for n, *_ in trees}
        wall: dict[str, list[float]] = {n: [] for n, *_ in trees}
        for i in range(args.steps + 1):
            for name, _, mods, loops in trees:
                _set_tree(mods)
                t, c = time.perf_counter(), time.thread_time()
                loops[key]()
                if i:  # the first step of each warms up
                    cpu[name].append(time.thread_time() - c)
                    wall[name].append(time.perf_counter() - t)
        a, b = (statistics.median(cpu[n]) * 1e3 for n, *_ in trees)
        wa, wb = (statistics.median(wall[n]) * 1e3 for n, *_ in trees)
        print(f"{key[0]} batch {key[1]}, {torch.get_num_threads()} threads, {args.steps} alternated steps: "
              f"CPU ms/step {trees[0][0]} {a:.2f}, {trees[1][0]} {b:.2f} (ratio {a / b:.3f}); wall {wa:.2f} / "
              f"{wb:.2f} (ratio {wa / wb:.3f}); load {os.getloadavg()[0]:.2f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,8", help="engine batch sizes (the step loop runs at batch 1)")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per case")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every case this many times (interleaved)")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=25, help="profiler table rows")
    ap.add_argument("--time-only", action="store_true")
    ap.add_argument("--loops", default="step,engine")
    ap.add_argument("--compare", metavar="SRC", help="another checkout's src/ (e.g. a worktree of main): build "
                    "both trees' models and engines in this process and alternate their decode steps one by "
                    "one (the same weights; the ratio is this tree's time / the other's)")
    ap.add_argument("--compare-first", action="store_true", help="build the other tree first")
    ap.add_argument("--int8", action="store_true", help="the real INT8 model (lowbit_decode.int8_model) with an int8 "
                    "KV cache instead of the fp32 model (not with --compare)")
    args = ap.parse_args(argv)

    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.2f}")
    if args.compare:
        if args.int8:
            ap.error("--int8 runs without --compare (one tree per process)")
        for t in map(int, args.threads.split(",")):
            torch.set_num_threads(t)
            with torch.inference_mode():
                for _ in range(args.rounds):
                    compare(args)
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
        return 0
    model = build()
    if args.int8:
        from lowbit_decode import int8_model

        model = int8_model(model, 50257)
    cases = [(k, b) for k in args.loops.split(",") for b in ([1] if k == "step" else map(int, args.batches.split(",")))]
    for _ in range(args.rounds):
        for t in map(int, args.threads.split(",")):
            torch.set_num_threads(t)
            for kind, b in cases:
                with torch.inference_mode():
                    case(model, kind, b, args)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
