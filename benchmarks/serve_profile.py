"""Where a served token's CPU time goes: `gptforge serve` in this process, `serve_load.py`'s
client in another, at N streaming clients.

The server runs exactly what `gptforge serve --max-batch-size 64` runs (the GPT-2 124M shape of
serve_load, random weights): the engine thread and uvicorn's event loop on a thread of its
own. Measured per generated token:

- CPU time of every thread of the server (from /proc: the engine thread, the event loop's
  thread, torch's worker threads and the rest) and of the client process;
- inside the engine thread (time.thread_time / perf_counter around the engine's own methods):
  scheduling, the model step, the sampler, the output processor, and the hand-off of events
  to the event loop; wall time beside CPU time (the difference is waiting: the GIL, the OS);
- with `--cprofile-loop`, the event loop thread's functions under cProfile (slower; for the
  split only).

    .venv/bin/python benchmarks/serve_profile.py [--clients 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(tid: int) -> float:
    """CPU seconds (user + system) of thread `tid` of this process."""
    with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def all_threads() -> dict[int, float]:
    return {int(t): thread_cpu(int(t)) for t in os.listdir("/proc/self/task")}


class Timers:
    """CPU (thread_time) and wall seconds per phase, engine thread only (nested phases count in both)."""

    def __init__(self):
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            c, w = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.cpu[name] += time.thread_time() - c
                self.wall[name] += time.perf_counter() - w
                self.calls[name] += 1
        return timed


def instrument(state, timers: Timers) -> None:
    from gptforge.serve import bridge

    core = state.engine.core
    core.schedule = timers.wrap("schedule", core.schedule)
    core.step = timers.wrap("step (all of it)", core.step)
    core.slots.step = timers.wrap("model step", core.slots.step)
    core._choose = timers.wrap("sampler", core._choose)
    core.output.record = timers.wrap("output processor (incl. hand-off)", core.output.record)
    bridge.Run._sink = timers.wrap("hand-off to the event loop", bridge.Run._sink)


def start_server(ours: Path, threads: int, loop_profile: cProfile.Profile | None):
    import torch

    from gptforge.generate.loader import load_runnable
    from gptforge.serve.server import DrainingServer, ServeOptions, build_state

    torch.set_num_threads(threads)
    model, cfg, tok = load_runnable(ours)
    opts = ServeOptions(model_name=ours.name, port=0, max_batch_size=64, max_queue=1024)
    state = build_state(model, tok, cfg.Generation, opts)
    server = DrainingServer(state, opts, log_level="warning")
    ids: dict[str, int] = {}

    def run():
        ids["loop"] = threading.get_native_id()
        if loop_profile is not None:
            loop_profile.enable()
        server.run()
        if loop_profile is not None:
            loop_profile.disable()

    t = threading.Thread(target=run, name="uvicorn", daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.05)
    ids["engine"] = state.engine._thread.native_id
    return state, server, t, ids


def client(url: str, model: str, clients: int) -> tuple[dict, float]:
    """serve_load's client in a process of its own: (its level result, its CPU seconds)."""
    code = ("import asyncio, json, sys; sys.path.insert(0, sys.argv[1]); import serve_load; "
            "print(json.dumps(asyncio.run(serve_load.level(sys.argv[2], sys.argv[3], int(sys.argv[4]), "
            "serve_load.per_client(int(sys.argv[4]))))))")
    before = os.times()
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks"), url, model, str(clients)],
                         check=True, capture_output=True, text=True).stdout
    after = os.times()
    return json.loads(out), (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    p.add_argument("--warmup", type=int, default=4, help="clients of an unmeasured first round")
    p.add_argument("--cprofile-loop", action="store_true", help="profile the event loop's thread")
    args = p.parse_args()

    import serve_load

    prof = cProfile.Profile() if args.cprofile_loop else None
    with tempfile.TemporaryDirectory() as d:
        ours, _ = serve_load.make_models(Path(d))
        state, server, thread, ids = start_server(ours, args.threads, prof)
        url = f"http://127.0.0.1:{server.port}"
        try:
            client(url, ours.name, args.warmup)
            timers = Timers()
            instrument(state, timers)
            steps0, cpu0, wall0, load0 = state.engine.steps, all_threads(), time.perf_counter(), os.getloadavg()
            res, client_cpu = client(url, ours.name, args.clients)
            wall, cpu1, steps = time.perf_counter() - wall0, all_threads(), state.engine.steps - steps0
        finally:
            server.begin_drain()
            thread.join(60)
    load1 = os.getloadavg()
    tokens = res["tokens"]
    per = 1e3 / tokens
    spent = {t: cpu1[t] - cpu0.get(t, 0.0) for t in cpu1}
    engine, loop = spent.pop(ids["engine"], 0.0), spent.pop(ids["loop"], 0.0)
    others = sum(spent.values())
    print(f"clients {args.clients}, torch threads {args.threads}: {tokens} tokens in {wall:.2f} s = "
          f"{tokens / wall:.1f} tok/s, {steps} engine steps ({tokens / max(steps, 1):.1f} tokens/step); "
          f"TTFT p50 {res['ttft_p50']:.2f} s p99 {res['ttft_p99']:.2f} s; load {load0[0]:.2f} -> {load1[0]:.2f}")
    print(f"CPU ms per token: engine thread {engine * per:.2f}, event loop thread {loop * per:.2f}, "
          f"other server threads (torch workers, ...) {others * per:.2f}, client process {client_cpu * per:.2f}; "
          f"wall ms per token {wall * per:.2f}")
    print("engine thread phases (ms per token: CPU / wall; calls):")
    for name in timers.cpu:
        print(f"  {name:40s} {timers.cpu[name] * per:7.3f} / {timers.wall[name] * per:7.3f}  {timers.calls[name]}")
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())


if __name__ == "__main__":
    main()
