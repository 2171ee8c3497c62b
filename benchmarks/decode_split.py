"""Where the batch-1 engine step's time goes outside the kernels (issue #32), fused step on and off.

    PYTHONPATH=src .venv/bin/python benchmarks/decode_split.py --weights wo-int8 fp32 --steps 40
    PYTHONPATH=src .venv/bin/python benchmarks/decode_split.py --weights wo-int4 int8 --threads 2

GPT-2 124M shape, random weights (`lowbit_decode.build`; `int8`: its real INT8 model), prompt 32
random tokens, greedy, one sequence, `--threads` (default one): the offline engine's step
(`EngineCore.step`, what `generate` runs). Every phase is timed by the calling thread's CPU time
(`time.thread_time`, not counting the time other processes hold the core; with more threads it
also counts the calling thread's waits for the others, which spin) through wrappers around the
engine's own methods:

- schedule: `EngineCore.schedule` (drop cancelled, admit, plan);
- batch: building the `RaggedBatch` (token/position tensors, native-attention rows);
- forward: the model's block stack (`step_ragged` minus the head), fused or Python;
- head: `TorchBackend.project` (the tied LM head and its GEMV);
- sampler: `Sampler.score` + `Sampler.choose` + the log-probs of the chosen token (`Scored.logprobs`);
- output: `OutputProcessor.record` (events, EOS / length checks, text when a tokenizer is given);
- engine glue: the rest of `EngineCore.step`.

Then `torch.profiler` over the same steps splits the forward's CPU time by op: gptforge's kernels
(`gptforge_wo::linear`, `linear_q8a`, `fp32_gemv`, `decode_attention`), the other ATen ops (count and
self time; the profiler's own cost per op inflates these), and the fused op's own glue
(`gptforge_wo::fused_decode` self time). Python = forward - everything the profiler saw, from the
unprofiled timing (an estimate: the profiler slows every op a little).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import EngineLoop  # noqa: E402 - the engine's decode step
from int8_speed import cpu_name  # noqa: E402 - the shared CPU line
from lowbit_decode import build, int8_model, weight_only_model  # noqa: E402 - the shared models

PHASES = ("schedule", "batch", "forward", "head", "sampler", "output", "engine glue", "step")


class Phases:
    """Thread-CPU-time accumulators around methods (instance or class attributes)."""

    def __init__(self):
        self.t: dict[str, float] = collections.defaultdict(float)
        self._undo = []

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)
        acc = self.t

        def timed(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                acc[label] += time.thread_time() - t0
        self._undo.append((owner, name, owner.__dict__.get(name) if isinstance(owner, type) else None))
        setattr(owner, name, timed)

    def undo(self) -> None:
        for owner, name, old in reversed(self._undo):
            if isinstance(owner, type):
                setattr(owner, name, old)
            else:
                delattr(owner, name)


def split(loop: EngineLoop, steps: int) -> dict[str, float]:
    """Milliseconds per step in each phase (medians would not add up: means over `steps`)."""
    from gptforge.generate.engine import sampler as sampler_mod
    from gptforge.generate.slots import RaggedBatch

    core = loop.core
    be = core.slots.backend
    ph = Phases()
    ph.wrap(core, "schedule", "schedule")
    ph.wrap(RaggedBatch, "__init__", "batch")
    ph.wrap(be, "step_ragged", "step_ragged")
    ph.wrap(be, "project", "head")
    ph.wrap(core.sampler, "score", "sampler")
    ph.wrap(core.sampler, "choose", "sampler")
    ph.wrap(sampler_mod.Scored, "logprobs", "sampler")
    ph.wrap(core.output, "record", "output")
    try:
        t0 = time.thread_time()
        for _ in range(steps):
            loop()
        total = time.thread_time() - t0
    finally:
        ph.undo()
    t = {k: v / steps * 1e3 for k, v in ph.t.items()}
    out = {"schedule": t["schedule"], "batch": t["batch"], "forward": t["step_ragged"] - t["head"],
           "head": t["head"], "sampler": t["sampler"], "output": t["output"], "step": total / steps * 1e3}
    out["engine glue"] = out["step"] - sum(v for k, v in out.items() if k != "step")
    return out


def op_split(loop: EngineLoop, steps: int) -> dict[str, float]:
    """Per step: self CPU ms of gptforge's kernels, of the fused op's glue, of the other ops, and
    the number of top-level ATen ops (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            loop()
    kern = glue = other = 0.0
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3 / steps
        if e.key == "gptforge_wo::fused_decode":
            glue += ms
        elif e.key.startswith("gptforge_wo::"):
            kern += ms
        elif "::" in e.key:
            other += ms
    top = sum(1 for e in prof.events() if "::" in e.name and e.cpu_parent is None) / steps
    return {"kernels": kern, "fused glue": glue, "other ops": other, "top-level ops": top}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", nargs="+", default=["wo-int8"], choices=["fp32", "wo-int8", "wo-int4", "int8"])
    ap.add_argument("--kernel", default="native", choices=["native", "native-q8a"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of fused on / off (medians)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the kernels share them)")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads: at least 1, got {args.threads}")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    os.environ["GPTFORGE_WEIGHT_KERNEL"] = args.kernel
    from gptforge.generate.backend import TorchBackend
    from gptforge.generate.fused_step import FUSED_ENV

    print(f"machine: {cpu_name()}; torch {torch.__version__}; load average {os.getloadavg()}")
    model, _ = build("124M")
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 50257, (32,), generator=g).tolist()
    for w in args.weights:
        m = (model if w == "fp32" else int8_model(model, 50257) if w == "int8"
             else weight_only_model(model, 8 if w == "wo-int8" else 4))
        rows: dict[str, list[dict]] = {"python": [], "fused": []}
        ops: dict[str, dict] = {}
        with TorchBackend(m) as be, torch.inference_mode():
            loop = EngineLoop(be, 1, (args.rounds * 2 + 2) * (2 * args.steps) + 8, prompt=prompt)
            for r in range(args.rounds + 1):
                for mode in ("python", "fused"):
                    os.environ[FUSED_ENV] = "off" if mode == "python" else "auto"
                    if r == 0:  # warm-up, then the op split once per mode
                        split(loop, 3)
                        ops[mode] = op_split(loop, args.steps // 2)
                    else:
                        rows[mode].append(split(loop, args.steps))
        os.environ.pop(FUSED_ENV, None)
        kern = "" if w in ("fp32", "int8") else f" {args.kernel}"
        print(f"\n### {w}{kern}: engine step, batch 1, {args.threads} thread(s), thread CPU ms per step (mean of {args.steps} steps, "
              f"median of {args.rounds} interleaved rounds); load average {os.getloadavg()}\n")
        print("| phase | Python step | fused step |")
        print("|---|---:|---:|")
        for p in PHASES:
            a, b = (statistics.median(x[p] for x in rows[mode]) for mode in ("python", "fused"))
            print(f"| {p} | {a:.2f} | {b:.2f} |")
        print("\nforward by op (torch.profiler, self CPU ms per step; its per-op cost inflates the op times):\n")
        print("| | Python step | fused step |")
        print("|---|---:|---:|")
        for k, label in (("kernels", "gptforge kernels called as ops"),
                         ("fused glue", "fused op's self time (the kernels it calls directly + its glue)"),
                         ("other ops", "other ops (ATen, oneDNN)"), ("top-level ops", "top-level ops per step")):
            fmt = "{:.0f}" if k == "top-level ops" else "{:.2f}"
            print(f"| {label} | {fmt.format(ops['python'][k])} | {fmt.format(ops['fused'][k])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
