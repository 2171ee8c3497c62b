"""Batch-1 greedy decode: llama.cpp on our GGUF export vs gptforge, at each precision.

    .venv/bin/python benchmarks/lowbit_decode.py                       # 124M and 345M, 64 tokens, 3 rounds
    .venv/bin/python benchmarks/lowbit_decode.py --presets 124M --rounds 5 --threads 2

Random weights of the GPT-2 124M / 345M shapes (the reference's init; nothing is downloaded),
GPT-2's vocabulary (50257 tokens; our model pads it to 50304 rows, the GGUF export leaves the
padding out). One prompt of `--prompt` random tokens, then `--new-tokens` greedy tokens; per-token
decode time after the prompt. The engines, all at the same thread count:

- gptforge fp32: the decode loop `gptforge generate` runs (`--loop engine`, the default: one
  `EngineCore.step` of the offline engine per token, greedy, batch 1: `TorchBackend` with packed
  fp32 weights, per-sequence slots with the native decode attention, sampler and output
  processing; `--loop step`: the bare `TorchBackend.step` over a `KVCache` with SDPA attention);
- gptforge int8: the real INT8 model (`gptforge ptq` + `quantize --convert`: per-channel int8
  weights, static int8 activations, int8 embedding / head) through the same loop;
- gptforge wo-int8 / wo-int4: `gptforge quantize --weights int8|int4` of the same weights (int8
  per row; int4 symmetric groups of 64; the head int8 in the same groups), each three ways: `native`
  (gptforge's own kernels, today's `auto`) and `before` (`GPTFORGE_WEIGHT_KERNEL=packed`: the
  choice `auto` made before them, PyTorch's packed kernels where exact, else dequantize), and
  `native-q8a` (the opt-in variant with int8 activations per 32 columns, llama.cpp's scheme);
- gptforge wo-bf16: `gptforge quantize --weights bf16 --head-bits 16` of the same weights (block
  Linears and the tied head in bf16), `native` (the native kernels widening bf16 to fp32, on any
  CPU) and `before` (the choice before them: oneDNN bf16 where the CPU has it, else a bf16 -> fp32
  copy and `F.linear` per call);
- llama.cpp (llama-cpp-python) on `gptforge export --format gguf` files: f32, f16, q8_0, q4_0
  (q4_0 keeps the tied head at q8_0); its default f16 KV cache; `eval` of one token per step
  and an argmax over its logits, as ours.

`--compare-fused`: every gptforge engine runs twice per round, with the fused one-sequence decode
step (`generate/fused_step.py`, the default) and with `GPTFORGE_FUSED_DECODE=off` (the Python
step), interleaved in the same rounds; the report adds their ratios.

`--compare-screen`: every gptforge engine whose head can be screened (fp32, bf16 head) runs
again with `GPTFORGE_HEAD_SCREEN=off` (the whole head computed every token; llama.cpp computes
every logit), interleaved in the same rounds; the report adds their ratios. gptforge's loop reads
no scores, as `gptforge generate` streaming text, so greedy decoding screens the head by default
(`transforms/head_screen.py`: the same tokens).

llama.cpp's f16 figure stands alone. Rounds interleave every engine (load from other processes
hits all alike); reported: median of the per-round medians, and the spread (min-max of the round
medians), with the load average before and after and the CPU name. The int4 (and bf16)
weight-streaming limit: the model's weight bytes read per token over a bandwidth probe's GB/s
(see `lowbit_kernels.py`), probed once in every round and taken at its fastest (on a shared host
the probe moved between 45 and 75 GB/s from run to run: a limit is what the machine can do).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import EngineLoop  # noqa: E402 - the engine's decode step
from int8_speed import cpu_name, decode_times  # noqa: E402 - the shared decode loop and CPU line
from lowbit_kernels import bandwidth_gbs  # noqa: E402 - the shared bandwidth probe

LLAMA_TYPES = ("f32", "f16", "q8_0", "q4_0")


def build(preset: str, seed: int = 0):
    from gptforge.config import load_config
    from gptforge.model import build_model

    cfg = load_config(overrides=[f"Model.preset={preset}", "Data.tokenizer=gpt2", "Model.hidden_dropout_prob=0",
                                 "Model.attention_probs_dropout_prob=0"])
    torch.manual_seed(seed)
    return build_model(cfg.Model).eval(), cfg


def int8_model(model, vocab: int, seed: int = 1):
    """`gptforge ptq` + `quantize --convert` on `model`: calibrated on one random batch."""
    from gptforge.compress.ptq import calibrate
    from gptforge.config.schema import QuantizationConfig
    from gptforge.transforms.int8 import convert_model
    from gptforge.transforms.quant import quantize_model

    q = QuantizationConfig(enable=True, weight_quantize_type="channel_wise_abs_max",
                           activation_preprocess_type="PACT", quantize_embedding=True)
    m = quantize_model(copy.deepcopy(model), q)
    g = torch.Generator().manual_seed(seed)
    calibrate(m, [torch.randint(0, vocab, (2, 128), generator=g)], "abs_max")
    convert_model(m)
    return m


WO_FORMATS = {"int8": 8, "int4": 4, "bf16": 16}


def weight_only_model(model, bits: int):
    """`gptforge quantize --weights int8|int4` (round to nearest, its default grouping; the head int8) or
    `--weights bf16 --head-bits 16` (bits 16) of `model`."""
    from gptforge.transforms.weight_only import WeightOnlySpec, quantize_rtn_model

    spec = WeightOnlySpec(bits=bits, group_size=64 if bits == 4 else 0, head_bits=16 if bits == 16 else 8)
    return quantize_rtn_model(copy.deepcopy(model), spec)


@contextlib.contextmanager
def kernel_env(value: str | None, var: str = "GPTFORGE_WEIGHT_KERNEL"):
    """`var`=value for one engine's turn (None: unset, `auto`)."""
    old = os.environ.pop(var, None)
    if value:
        os.environ[var] = value
    try:
        yield
    finally:
        os.environ.pop(var, None)
        if old is not None:
            os.environ[var] = old


def _last_logits(llm) -> np.ndarray:
    import llama_cpp

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


CLOCK = [time.perf_counter]  # --cpu-time (one thread): time.thread_time, for both engines


def llama_times(llm, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
    """(prefill seconds, per-token seconds) of llama.cpp's greedy decode through llama-cpp-python."""
    clock = CLOCK[0]
    llm.reset()
    t0 = clock()
    llm.eval(prompt)
    prefill = clock() - t0
    tok = int(np.argmax(_last_logits(llm)))
    steps = []
    for _ in range(new_tokens):
        t = clock()
        llm.eval([tok])
        tok = int(np.argmax(_last_logits(llm)))
        steps.append(clock() - t)
    return prefill, steps


def engine_times(model, ids: list[int], new_tokens: int) -> list[float]:
    """Per-token seconds of batch-1 greedy decode through the offline engine (`generate`'s loop)."""
    from gptforge.generate.backend import TorchBackend

    with TorchBackend(model) as be, torch.inference_mode():
        loop = EngineLoop(be, 1, new_tokens, prompt=ids)
        clock = CLOCK[0]
        steps = []
        for _ in range(new_tokens):
            t = clock()
            loop()
            steps.append(clock() - t)
    return steps


UNFUSED = "(python step)"  # the suffix of --compare-fused's twins: GPTFORGE_FUSED_DECODE=off


@contextlib.contextmanager
def fused_env(off: bool):
    """GPTFORGE_FUSED_DECODE=off for one engine's turn (else unset: the fused step where it applies)."""
    old = os.environ.pop("GPTFORGE_FUSED_DECODE", None)
    if off:
        os.environ["GPTFORGE_FUSED_DECODE"] = "off"
    try:
        yield
    finally:
        os.environ.pop("GPTFORGE_FUSED_DECODE", None)
        if old is not None:
            os.environ["GPTFORGE_FUSED_DECODE"] = old


def _turn(name: str, eng, prompt, ids, n: int, loop: str = "engine") -> list[float]:
    """One engine's per-token decode seconds for `n` greedy tokens."""
    if not name.startswith("gptforge"):
        return llama_times(eng, ids, n)[1]
    if name.endswith(FULL_HEAD):
        with kernel_env("off", "GPTFORGE_HEAD_SCREEN"):
            return _turn(name.removesuffix(FULL_HEAD).rstrip(), eng, prompt, ids, n, loop)
    off = name.endswith(UNFUSED)
    kern = name.removesuffix(UNFUSED).split()[-1]
    int8_kern = kern if name.startswith("gptforge int8 ") else None  # --int8-kernels: the real INT8 model's path
    with kernel_env({"before": "packed", "native-q8a": "native-q8a"}.get(kern)), fused_env(off), \
            kernel_env(int8_kern, "GPTFORGE_INT8_KERNEL"):
        return engine_times(eng, ids, n) if loop == "engine" else decode_times(eng, prompt, n, True)[1]


FULL_HEAD = "(full head)"  # the suffix of --compare-screen's twins: GPTFORGE_HEAD_SCREEN=off


def _with_twin(name: str) -> tuple[str, ...]:
    """`name` and, where the fused step can apply (not llama.cpp, not the real INT8 model on fbgemm's
    paths), its Python-step twin."""
    fbgemm = name.startswith("gptforge int8") and name.split()[-1] in ("split", "plain")
    return (name, f"{name} {UNFUSED}") if name.startswith("gptforge") and not fbgemm else (name,)


PROBES: list[float] = []  # the bandwidth probe's GB/s, one per round of the preset being run


def run_preset(preset: str, args, tmp: Path) -> list[tuple[str, list[float], int]]:
    """[(engine, per-round median seconds per token, weight bytes)] for one model shape."""
    import llama_cpp

    from gptforge.compress.int8_convert import state_bytes
    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.export.gguf import save_gguf

    model, cfg = build(preset)
    tok = gpt2_tokenizer()
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, tok.vocab_size, (1, args.prompt), generator=g)
    engines: dict[str, tuple[object, int]] = {"gptforge fp32": (model, state_bytes(model))}
    q = int8_model(model, tok.vocab_size)
    for kern in args.int8_kernels:
        engines["gptforge int8" + ("" if kern == "auto" else f" {kern}")] = (q, state_bytes(q))
    for fmt in args.wo_formats if args.wo_kernels else ():
        wo = weight_only_model(model, WO_FORMATS[fmt])
        for kern in args.wo_kernels:
            if not (fmt == "bf16" and kern == "native-q8a"):  # no int8-activation variant for bf16 weights
                engines[f"gptforge wo-{fmt} {kern}"] = (wo, state_bytes(wo))
    for t in args.llama_types:
        path = tmp / f"{preset}_{t}.gguf"
        r = save_gguf(model, path, tok, t, model_cfg=cfg.Model)
        llm = llama_cpp.Llama(str(path), n_ctx=args.prompt + args.new_tokens + 8, n_batch=args.prompt,
                              n_threads=args.threads, n_threads_batch=args.threads, verbose=False, seed=0,
                              use_mmap=not args.llama_no_mmap)
        engines[f"llama.cpp {t}"] = (llm, r.bytes)
    if args.compare_fused:  # each engine the fused step applies to again with the Python step, same rounds
        engines = {k2: v for k, v in engines.items() for k2 in _with_twin(k)}
    if args.compare_screen:  # fp32 and bf16-head engines again with the whole head every token
        engines = {k2: v for k, v in engines.items() for k2 in (
            (k, f"{k} {FULL_HEAD}") if k.startswith(("gptforge fp32", "gptforge wo-bf16")) else (k,))}
    ids = prompt[0].tolist()
    for name, (eng, _) in engines.items():  # warm-up: first-call packing, page faults of the mapped file
        _turn(name, eng, prompt, ids, 2, args.loop)
    rounds: dict[str, list[float]] = {k: [] for k in engines}
    PROBES.clear()
    for _ in range(args.rounds):
        for name, (eng, _) in engines.items():
            rounds[name].append(statistics.median(_turn(name, eng, prompt, ids, args.new_tokens, args.loop)))
        PROBES.append(bandwidth_gbs())  # in every round: the machine's bandwidth moves with its neighbours
    for name, (eng, _) in engines.items():
        if not name.startswith("gptforge"):
            eng.close()
    return [(name, rounds[name], engines[name][1]) for name in engines]


def report(preset: str, rows, args) -> None:
    print(f"\n### {preset}: batch 1, prompt {args.prompt}, {args.new_tokens} greedy tokens, {args.threads} threads, "
          f"{args.rounds} interleaved rounds, gptforge's {args.loop} loop, "
          f"{'thread CPU time' if CLOCK[0] is time.thread_time else 'wall time'}\n")
    print("| engine | weights | tokens/s (median) | spread (min-max of rounds) | ms/token | weight MB |")
    print("|---|---|---:|---:|---:|---:|")
    for name, per_round, nbytes in rows:
        med = statistics.median(per_round)
        lo, hi = 1 / max(per_round), 1 / min(per_round)
        print(f"| {name.split()[0]} | {' '.join(name.split()[1:])} | {1 / med:.1f} | {lo:.1f}-{hi:.1f} | {med * 1e3:.1f} | "
              f"{nbytes / 1e6:.0f} |")
    tps = {name: 1 / statistics.median(r) for name, r, _ in rows}
    pairs = (("gptforge fp32", "llama.cpp f32"), ("gptforge int8", "llama.cpp q8_0"),
             ("gptforge wo-int8 native", "llama.cpp q8_0"), ("gptforge wo-int4 native", "llama.cpp q4_0"),
             ("gptforge wo-bf16 native", "llama.cpp f16"), ("gptforge wo-bf16 native", "gptforge wo-bf16 before"),
             ("gptforge wo-bf16 native", "gptforge fp32"),
             ("gptforge wo-int8 native", "gptforge wo-int8 before"), ("gptforge wo-int4 native", "gptforge wo-int4 before"),
             ("gptforge wo-int4 native", "gptforge int8"), ("gptforge wo-int8 native-q8a", "llama.cpp q8_0"),
             ("gptforge wo-int4 native-q8a", "llama.cpp q4_0"), ("gptforge int8 native", "gptforge int8 split"),
             ("gptforge int8 native", "llama.cpp q8_0"), ("gptforge int8 native", "gptforge fp32"))
    pairs += tuple((name, f"{name} {UNFUSED}") for name in tps if f"{name} {UNFUSED}" in tps)
    pairs += tuple((name, f"{name} {FULL_HEAD}") for name in tps if f"{name} {FULL_HEAD}" in tps)
    pairs += tuple((f"{name} {FULL_HEAD}", theirs) for name, theirs in (
        ("gptforge fp32", "llama.cpp f32"), ("gptforge wo-bf16 native", "llama.cpp f16")) if f"{name} {FULL_HEAD}" in tps)
    print()
    for ours, theirs in pairs:
        if ours in tps and theirs in tps:
            print(f"- {ours} / {theirs}: {tps[ours] / tps[theirs]:.2f}x")
    streamed = [(name, b) for name, _, b in rows if name in ("gptforge wo-int4 native", "gptforge wo-bf16 native")]
    bw = max(PROBES, default=0.0)  # a limit: the fastest the machine read in any round
    for name, nbytes in streamed:
        limit = bw * 1e9 / nbytes
        print(f"- {name.split()[1][3:]} weight-streaming limit: {nbytes / 1e6:.0f} MB per token at {bw:.1f} GB/s "
              f"(the fastest of {len(PROBES)} probes, one per round: {min(PROBES):.1f}-{bw:.1f} GB/s, "
              f"{torch.get_num_threads()} threads) = {limit:.1f} tok/s; {name} reaches {tps[name] / limit:.0%} of it")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["124M", "345M"])
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for both engines")
    ap.add_argument("--loop", choices=["engine", "step"], default="engine",
                    help="gptforge's decode loop: the offline engine `generate` runs, or the bare backend step")
    ap.add_argument("--cpu-time", action="store_true",
                    help="with --threads 1: time each token by the calling thread's CPU time (both engines compute "
                    "in it), not wall time, which on a shared machine counts the time other processes hold the core")
    ap.add_argument("--compare-fused", action="store_true",
                    help="time every gptforge engine also with GPTFORGE_FUSED_DECODE=off (the Python step), "
                    "interleaved in the same rounds")
    ap.add_argument("--compare-screen", action="store_true",
                    help="time the fp32 and bf16-head engines also with GPTFORGE_HEAD_SCREEN=off (the whole head), "
                    "interleaved in the same rounds")
    ap.add_argument("--int8-kernels", nargs="+", default=["auto"], choices=["auto", "split", "plain", "native"],
                    help="the real INT8 model's paths to time (GPTFORGE_INT8_KERNEL), each an engine of its own")
    ap.add_argument("--llama-types", nargs="+", default=list(LLAMA_TYPES), choices=LLAMA_TYPES)
    ap.add_argument("--llama-no-mmap", action="store_true",
                    help="llama.cpp reads its GGUF into memory instead of mapping it (sandboxes whose mmap it trips on)")
    ap.add_argument("--wo-kernels", nargs="*", default=["native", "native-q8a", "before"],
                    choices=["native", "native-q8a", "before"],
                    help="weight-only kernels to run (none: no weight-only models)")
    ap.add_argument("--wo-formats", nargs="+", default=list(WO_FORMATS), choices=list(WO_FORMATS),
                    help="weight-only formats to run with each of --wo-kernels")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: pip install 'gptforge[llama]'")
        return 2
    torch.set_num_threads(args.threads)
    if args.cpu_time:
        if args.threads != 1:
            print("--cpu-time needs --threads 1 (other threads' time would go uncounted)")
            return 2
        CLOCK[0] = time.thread_time
    from gptforge.transforms.cpu_kernels import describe

    load0 = os.getloadavg()
    print(f"machine: {cpu_name()}; {describe(onnxruntime=False)}; torch {torch.__version__}; llama-cpp-python "
          f"{llama_cpp.__version__}; load average {' '.join(f'{v:.2f}' for v in load0)}")
    with tempfile.TemporaryDirectory(prefix="lowbit-decode-") as d:
        for preset in args.presets:
            rows = run_preset(preset, args, Path(d))
            report(preset, rows, args)
            print(f"(load average now {' '.join(f'{v:.2f}' for v in os.getloadavg())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
