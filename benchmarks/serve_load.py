"""Serving under load: `gptforge serve` vs `transformers serve`, same weights, same client.

Model: GPT-2 124M shape (`Model.preset=124M`, vocabulary 50257, random weights), saved as our
model directory and as an HF directory with identical weights. Servers run one after the other
(never side by side), each as its own process on 127.0.0.1:

- gptforge serve (continuous batching, defaults except --max-batch-size 64);
- gptforge serve --max-batch-size 1 (one request at a time: the baseline of the goals);
- transformers serve --continuous-batching --device cpu (the peer; it runs offline from a local
  directory).

Clients (1, 4, 16, 64 at once) each send their requests one after another, streamed
(/v1/completions, temperature 0, SSE) with mixed prompt and output lengths drawn from a fixed
seed: prompts of ~16/32/64 tokens, 32/48/64 new tokens (1 client: 2 requests, more clients: 1 each). Reported per level: output tokens/s
(all tokens / wall time), p50/p99 time to first token and p50/p99 inter-token latency (gaps
between streamed tokens). Before the load, one greedy prompt is checked to give the same text
on both servers (same weights, same greedy decoding).

    .venv/bin/python benchmarks/serve_load.py [--clients 1,4,16,64] [--out FILE.md]

`--int8`: the same weights as a real INT8 model with an int8 KV cache, a server of its own.
`--baseline CHECKOUT`: the fp32 weights also served by another checkout's gptforge (from the HF
directory, which every tree's loader reads), in the same rounds: e.g. the tree an issue's
"today's figure" was measured on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BASELINE_SERVER = "gptforge serve, --baseline tree (fp32)"
INT8_SERVER = "gptforge serve, INT8 weights + int8 KV cache"
PROMPT_WORDS = [16, 32, 64]  # roughly tokens: the words are common single-token words
OUTPUTS = [32, 48, 64]
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "an", "are", "which", "or", "had", "it", "be", "this", "not", "but", "have", "were", "her", "one", "all", "they", "their", "been", "has", "who", "when", "more", "there", "can", "its", "into", "other", "time", "would", "some", "him", "so", "only", "over", "new", "she", "what", "years", "first", "may", "after", "two", "these", "also", "could"]


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_flags() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(x for x in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
                                if x in have)
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_models(tmp: Path) -> tuple[Path, Path]:
    import torch

    from gptforge.config import load_config
    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.model import build_model
    from gptforge.model_io import save_hf_dir, save_model_dir

    torch.manual_seed(0)
    cfg = load_config(overrides=["Model.preset=124M", "Model.vocab_size=50257", "Model.hidden_dropout_prob=0",
                                 "Model.attention_probs_dropout_prob=0"])
    model = build_model(cfg.Model).eval()
    ours, hf = tmp / "gpt2-124m", tmp / "gpt2-124m-hf"
    save_model_dir(model, cfg, ours, gpt2_tokenizer())
    save_hf_dir(model, cfg, hf, gpt2_tokenizer())
    return ours, hf


def make_int8(tmp: Path, ours: Path) -> Path:
    """The same weights as a real INT8 model (int8 Linears, static int8 activations, int8
    embedding / head): calibrated PTQ-style on random tokens, then `quantize --convert`'s code."""
    import dataclasses

    import torch

    from gptforge.compress.int8_convert import convert_checkpoint
    from gptforge.compress.ptq import calibrate
    from gptforge.config.schema import QuantizationConfig
    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.model_io import load_model, save_model_dir
    from gptforge.transforms.quant import quantize_model

    model, cfg = load_model(ours, device="cpu")
    q = QuantizationConfig(enable=True, weight_quantize_type="channel_wise_abs_max",
                           activation_preprocess_type="PACT", quantize_embedding=True)
    fake = quantize_model(model.eval(), q)
    g = torch.Generator().manual_seed(1)
    calibrate(fake, [torch.randint(0, 50257, (2, 128), generator=g)], "abs_max")
    cfg = dataclasses.replace(cfg, Compress=dataclasses.replace(cfg.Compress, Quantization=q))
    fq, out = tmp / "gpt2-124m-fq", tmp / "gpt2-124m-int8"
    save_model_dir(fake, cfg, fq, gpt2_tokenizer())
    convert_checkpoint(fq, out, int8_embedding=True, check=False, echo=False)
    return out


@contextlib.contextmanager
def server(cmd: list[str], port: int, env: dict, log: Path):
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[:3]} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def workload(clients: int, per_client: int, seed: int = 0) -> list[list[tuple[str, int]]]:
    rng = random.Random(seed * 1000 + clients)
    return [[(" ".join(rng.choice(WORDS) for _ in range(rng.choice(PROMPT_WORDS))), rng.choice(OUTPUTS))
             for _ in range(per_client)] for _ in range(clients)]


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times, tokens, usage = [], 0, None
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
                tokens += 1
            if chunk.get("usage"):  # exact count (a chunk may hold less than one character)
                usage = chunk["usage"]["completion_tokens"]
    return {"ttft": times[0] - t0 if times else None, "itl": [b - a for a, b in zip(times, times[1:], strict=False)],
            "tokens": usage if usage is not None else tokens}


async def level(url: str, model: str, clients: int, per_client: int) -> dict:
    work = workload(clients, per_client)
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def run_client(items):
            return [await one(client, url, model, p, n) for p, n in items]

        t0 = time.perf_counter()
        results = await asyncio.gather(*[run_client(w) for w in work])
        wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    ttft = sorted(r["ttft"] for r in flat if r["ttft"] is not None)
    itl = sorted(x for r in flat for x in r["itl"])
    tokens = sum(r["tokens"] for r in flat)

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")

    return {"clients": clients, "requests": len(flat), "tokens": tokens, "wall": wall, "tok_s": tokens / wall,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}


def greedy_text(url: str, model: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": "The history of the city begins", "max_tokens": 12, "temperature": 0})
    return r.json()["choices"][0]["text"]


def per_client(clients: int) -> int:
    return max(1, 2 // clients)


def run_all(args) -> str:
    # src first, then any PYTHONPATH the caller set (packages installed beside the interpreter's own)
    pythonpath = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}
    levels = [int(x) for x in args.clients.split(",")]
    rows, checks = [], {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ours, hf = make_models(tmp)
        py = sys.executable
        tf_cli = [py, "-m", "transformers.cli.transformers"]  # the `transformers` script's own entry
        setups = [
            ("gptforge serve", [py, "-m", "gptforge", "serve", "--ckpt", str(ours), "--max-batch-size", "64",
                                "--max-queue", "1024", "--log-level", "warning"], "gpt2-124m", levels),
            ("gptforge serve, one request at a time", [py, "-m", "gptforge", "serve", "--ckpt", str(ours),
                                                       "--max-batch-size", "1", "--max-queue", "1024",
                                                       "--log-level", "warning"], "gpt2-124m",
             [x for x in levels if x in (1, 16)]),
            ("transformers serve --continuous-batching", [*tf_cli, "serve", str(hf), "--continuous-batching",
                                                          "--device", "cpu", "--dtype", "float32"], str(hf), levels),
        ]
        if args.int8:
            int8 = make_int8(tmp, ours)
            setups.insert(1, (INT8_SERVER, [py, "-m", "gptforge", "serve", "--ckpt", str(int8), "--max-batch-size", "64",
                                            "--max-queue", "1024", "--kv-cache-dtype", "int8", "--log-level",
                                            "warning"], "gpt2-124m-int8", levels))
        if args.skip_one:
            setups = [x for x in setups if "one request at a time" not in x[0]]
        envs = {}
        if args.baseline:  # another checkout's fp32 server; it reads the HF directory (any tree's loader does)
            src = str(Path(args.baseline).resolve() / "src")
            setups.insert(1, (BASELINE_SERVER, [py, "-m", "gptforge", "serve", "--ckpt", str(hf), "--model-name",
                                                "gpt2-124m", "--max-batch-size", "64", "--max-queue", "1024",
                                                "--log-level", "warning"], "gpt2-124m", levels))
            envs[BASELINE_SERVER] = {**env, "PYTHONPATH": os.pathsep.join(
                p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}
        for rnd in range(args.rounds):  # the servers alternate, round after round
            for name, cmd, model, lv in setups:
                port = free_port()
                cmd = [*cmd, "--port", str(port)]
                print(f"== {name}" + (f" (round {rnd + 1} of {args.rounds})" if args.rounds > 1 else ""),
                      file=sys.stderr, flush=True)
                with server(cmd, port, envs.get(name, env), tmp / f"{len(rows)}.log") as url:
                    checks.setdefault(name, set()).add(greedy_text(url, model))  # every round's, to compare
                    for c in lv:
                        r = asyncio.run(level(url, model, c, per_client(c)))
                        r["server"], r["round"] = name, rnd
                        rows.append(r)
                        print(f"   {c:3d} clients: {r['tok_s']:7.1f} tok/s  ttft p50 {r['ttft_p50']:.3f} "
                              f"p99 {r['ttft_p99']:.3f}  itl p50 {r['itl_p50'] * 1e3:.1f} ms p99 "
                              f"{r['itl_p99'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    return report(rows, checks, load_before, load_after, args)


def round_goals(get, rnd: int) -> list[str]:
    """The goals' lines of one round (the servers' rows of that round)."""
    goals = []
    g16, one16 = get("gptforge serve", 16, rnd), get("gptforge serve, one request at a time", 16, rnd)
    peer16, g1 = get("transformers serve --continuous-batching", 16, rnd), get("gptforge serve", 1, rnd)
    if g16 and one16:
        goals.append(f"16 clients vs one request at a time: {g16['tok_s'] / one16['tok_s']:.2f}x (goal >= 4x)")
    if g16 and peer16:
        goals.append(f"16 clients vs transformers serve: {g16['tok_s'] / peer16['tok_s']:.2f}x (goal >= 2x)")
    if g16 and g1:
        goals.append(f"p99 ITL at 16 clients / batch-1 decode step (ITL p50 at 1 client): "
                     f"{g16['itl_p99'] / g1['itl_p50']:.2f}x (goal <= 2x)")
    i64, g64 = get(INT8_SERVER, 64, rnd), get("gptforge serve", 64, rnd)
    peer64 = get("transformers serve --continuous-batching", 64, rnd)
    if i64 and g64:
        goals.append(f"64 clients, INT8 + int8 KV vs fp32: {i64['tok_s'] / g64['tok_s']:.2f}x (goal >= 2x)")
    b64 = get(BASELINE_SERVER, 64, rnd)
    if i64 and b64:
        goals.append(f"64 clients, INT8 + int8 KV vs the --baseline tree's fp32: {i64['tok_s'] / b64['tok_s']:.2f}x")
    if i64 and peer64:
        goals.append(f"64 clients, INT8 + int8 KV vs transformers serve: {i64['tok_s'] / peer64['tok_s']:.2f}x "
                     "(goal > 1x)")
    if g64 and peer64:
        goals.append(f"64 clients vs transformers serve: {g64['tok_s'] / peer64['tok_s']:.2f}x, p99 TTFT "
                     f"{g64['ttft_p99']:.2f} s vs {peer64['ttft_p99']:.2f} s (goal: >= 2x at p99 TTFT <= the peer's)")
    return goals


def report(rows, checks, load_before, load_after, args) -> str:
    import torch

    def get(server, c, rnd=0):
        return next((r for r in rows if r["server"] == server and r["clients"] == c and r["round"] == rnd), None)

    rounds = 1 + max(r["round"] for r in rows)
    lines = [("| round " if rounds > 1 else "") + "| server | clients | requests | output tokens | wall s | output tok/s "
             "| TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms |",
             ("|---:" if rounds > 1 else "") + "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append((f"| {r['round'] + 1} " if rounds > 1 else "")
                     + f"| {r['server']} | {r['clients']} | {r['requests']} | {r['tokens']} | {r['wall']:.1f} | "
                     f"{r['tok_s']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {r['itl_p50'] * 1e3:.1f} | "
                     f"{r['itl_p99'] * 1e3:.1f} |")
    goals = []
    for rnd in range(rounds):
        goals += [(f"- round {rnd + 1}: " if rounds > 1 else "- ") + g for g in round_goals(get, rnd)]
    peer = "transformers serve --continuous-batching"
    pairs = [(get("gptforge serve", 64, k), get(peer, 64, k)) for k in range(rounds)]
    pairs = [(a, b) for a, b in pairs if a and b]
    if len(pairs) > 1:
        rs = sorted(a["tok_s"] / b["tok_s"] for a, b in pairs)
        under = sum(a["ttft_p99"] <= b["ttft_p99"] for a, b in pairs)
        goals.append(f"- 64 clients vs transformers serve over {len(pairs)} rounds: median {statistics.median(rs):.2f}x "
                     f"({rs[0]:.2f}-{rs[-1]:.2f}x), p99 TTFT <= the peer's in {under} of {len(pairs)}")
    checks = {k: v for k, v in checks.items() if k != INT8_SERVER}  # other weights: other text
    same = len(set().union(*checks.values())) == 1
    head = [f"Machine: {cpu_name()} ({os.cpu_count()} cores; flags {cpu_flags()}), torch {torch.__version__}, "
            f"{args.threads} thread(s) per server (OMP_NUM_THREADS).",
            f"Load average before/after: {' '.join(f'{x:.2f}' for x in load_before)} / "
            f"{' '.join(f'{x:.2f}' for x in load_after)}.",
            f"Command: `python benchmarks/serve_load.py --clients {args.clients} --threads {args.threads}"
            f"{' --int8' if args.int8 else ''}{' --skip-one' if args.skip_one else ''}"
            f"{f' --baseline {args.baseline}' if args.baseline else ''}"
            f"{f' --rounds {args.rounds}' if args.rounds > 1 else ''}`.",
            f"Greedy check (same prompt, both servers): {'identical text' if same else 'DIFFERENT: ' + repr(checks)}."]
    return "\n".join(head) + "\n\n" + "\n".join(lines) + "\n\n" + "\n".join(goals) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--int8", action="store_true",
                   help="also serve the same weights as a real INT8 model with an int8 KV cache")
    p.add_argument("--skip-one", action="store_true", help="leave out the one-request-at-a-time server")
    p.add_argument("--baseline", metavar="CHECKOUT", help="also serve the fp32 weights with another checkout's "
                   "gptforge (e.g. a worktree of the commit an issue was filed against), in the same rounds")
    p.add_argument("--rounds", type=int, default=1, help="run every server this many times, alternating, "
                   "and report the 64-client ratio's median and range (the host's speed drifts between runs)")
    p.add_argument("--out", help="also write the markdown table to this file")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of both servers (default 1: on a shared, oversubscribed 2-core machine "
                        "two threads per process run slower than one)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds: at least 1, got {args.rounds}")
    if args.baseline and not (Path(args.baseline) / "src" / "gptforge" / "__init__.py").is_file():
        # else its server would quietly import this tree's gptforge from PYTHONPATH
        p.error(f"--baseline {args.baseline}: no src/gptforge there; give a checkout of gptforge")
    text = run_all(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
