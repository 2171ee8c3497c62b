"""The reference's inference benchmark: input 128 tokens -> 8 generated, batch 1/2/4/8/16, for
fp32 and INT8, in PyTorch and in ONNX Runtime, in one run.

    .venv/bin/python benchmarks/inference_latency.py                      # GPT-2 124M shape, a few minutes
    .venv/bin/python benchmarks/inference_latency.py --shape 345M --iters 2

As `projects/gpt/benchmark.py` (spec §11): the input is token id 100 repeated 128 times; one
timed call generates exactly 8 tokens (prefill + 7 cached steps, no early stop); warm-up calls,
then the mean over `--iters` calls. All four engines run the same greedy decode loop
(`gptforge.generate.generate_ids`) through their `StepBackend`:

- torch fp32: our GPT through `gptforge generate`'s backend (KV cache, oneDNN-packed decode weights);
- torch int8: the `gptforge quantize --convert` model (fbgemm, exact int8 arithmetic);
- ORT fp32 / ORT int8: `gptforge export --format onnx` of the float / fake-quant model, run by
  `gptforge infer`'s `OrtBackend` (INT8: QDQ with uint8 storage, fused u8 GEMMs).

The models have random weights (the reference's init); the INT8 model is the reference's QAT
setting (per-tensor abs_max weights, static moving-average activations, PACT, embedding and LM
head float) with activation scales calibrated on one random batch. Engines run interleaved
(every engine per round) so that load from other processes hits all of them. `--kernels` adds
the one-Linear table behind the INT8 storage choice (docs/export.md).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

SHAPES = ("small", "124M", "345M")
REFERENCE_345M = {1: (18.91, 18.30), 2: (20.01, 18.88), 4: (20.83, 20.77), 8: (24.06, 23.90), 16: (29.32, 27.95)}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def build(shape: str, seed: int = 0):
    """(float model, fake-quant model, converted INT8 model, config)."""
    from gptforge.compress.ptq import calibrate
    from gptforge.config import load_config
    from gptforge.model import build_model
    from gptforge.transforms.int8 import convert_model
    from gptforge.transforms.quant import quantize_model

    cfg = load_config(overrides=[f"Model.preset={shape}", "Model.hidden_dropout_prob=0",
                                 "Model.attention_probs_dropout_prob=0", "Compress.Quantization.enable=true",
                                 "Compress.Quantization.weight_quantize_type=abs_max",
                                 "Compress.Quantization.activation_preprocess_type=PACT"])
    torch.manual_seed(seed)
    model = build_model(cfg.Model).eval()
    fq = quantize_model(copy.deepcopy(model), cfg.Compress.Quantization)
    g = torch.Generator().manual_seed(seed + 1)
    calibrate(fq, [torch.randint(0, 50257, (2, 128), generator=g)], "abs_max")
    fq.eval()
    int8 = copy.deepcopy(fq)
    convert_model(int8)
    return model, fq, int8, cfg


def run_once(backend, batch: int, args) -> tuple[float, torch.Tensor]:
    """(seconds, generated ids [batch, 8]) of one benchmark call."""
    from gptforge.config.schema import GenerationConfig
    from gptforge.generate import generate_ids

    g = GenerationConfig(decode_strategy="greedy_search", max_dec_len=args.output, early_finish=False)
    prompts = [[100] * args.input] * batch
    t = time.perf_counter()
    out = generate_ids(backend, prompts, g)
    return time.perf_counter() - t, out.tokens


def kernel_table(threads: int) -> None:
    """One Linear 1024 -> 4096 in onnxruntime: fp32 and INT8 QDQ with each storage and fusion."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    K, N = 1024, 4096
    w = rng.integers(-127, 128, (K, N)).astype(np.int8)
    ws = (rng.random(N) * 0.01 + 0.001).astype(np.float32)
    step = 0.05

    def graph(kind: str) -> bytes:
        x = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["r", K])]
        y = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["r", N])]
        if kind == "fp32":
            nodes = [helper.make_node("MatMul", ["x", "W"], ["y"])]
            return helper.make_model(helper.make_graph(nodes, "g", x, y, [numpy_helper.from_array(
                w.astype(np.float32) * ws, "W")]), opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
        dt, z = (np.uint8, 128) if kind == "uint8" else (np.int8, 0)
        inits = [numpy_helper.from_array((w.astype(np.int16) + z).astype(dt), "W"), numpy_helper.from_array(ws, "ws"),
                 numpy_helper.from_array(np.full(N, z, dt), "wz"),
                 numpy_helper.from_array(np.array(step, np.float32), "s"), numpy_helper.from_array(np.array(z, dt), "z")]
        nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
                 helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
                 helper.make_node("DequantizeLinear", ["W", "ws", "wz"], ["wd"], axis=1),
                 helper.make_node("MatMul", ["xd", "wd"], ["y"])]
        return helper.make_model(helper.make_graph(nodes, "g", x, y, inits),
                                 opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()

    rows_list = (1, 8, 128)
    print(f"\nOne Linear {K} -> {N} in onnxruntime ({threads} threads): median ms per call; error = largest "
          "deviation from exact int8 arithmetic / largest output")
    print("| graph | int8 GEMM | " + " | ".join(f"rows {r}" for r in rows_list) + " | error (rows 8) |")
    print("|---|---|" + "---:|" * (len(rows_list) + 1))
    for kind, fused in (("fp32", True), ("int8", True), ("int8", False), ("uint8", True), ("uint8", False)):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        if not fused:
            so.add_session_config_entry("session.disable_quant_qdq", "1")
        sess = ort.InferenceSession(graph(kind), so, providers=["CPUExecutionProvider"])
        cells, err = [], ""
        for rows in rows_list:
            q = rng.integers(-127, 128, (rows, K)).astype(np.float64)
            x = ((q + rng.uniform(-0.4, 0.4, q.shape)) * step).astype(np.float32)  # no rounding ties
            sess.run(None, {"x": x})
            ts = []
            for _ in range(20 if rows < 128 else 5):
                t = time.perf_counter()
                out = sess.run(None, {"x": x})[0]
                ts.append(time.perf_counter() - t)
            cells.append(f"{statistics.median(ts) * 1e3:.3f}")
            if rows == 8:
                exact = (q @ w.astype(np.float64)) * step * ws
                err = "(float)" if kind == "fp32" else f"{np.abs(out - exact).max() / np.abs(exact).max():.1e}"
        name = "fp32 MatMul" if kind == "fp32" else f"QDQ, {kind} storage"
        print(f"| {name} | {'-' if kind == 'fp32' else 'fused' if fused else 'unfused'} | " + " | ".join(cells)
              + f" | {err} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="124M",
                    help="model preset: 124M (GPT-2 small shape; default, a few minutes), 345M (the reference's), "
                         "small (30M, mostly embedding: INT8 barely matters)")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--input", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--output", type=int, default=8, help="generated tokens (default 8)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up calls per engine and batch (the reference: 10)")
    ap.add_argument("--iters", type=int, default=3, help="timed calls per engine and batch (mean)")
    ap.add_argument("--threads", type=int, default=None, help="torch and onnxruntime threads (default: torch's)")
    ap.add_argument("--kernels", action="store_true", help="also time one Linear in each onnxruntime INT8 form")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    batches = [int(b) for b in args.batches.split(",")]

    import onnxruntime as ort

    from gptforge.export.onnx import export_onnx
    from gptforge.generate.ort_backend import OrtBackend

    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {threads} threads; torch {torch.__version__}, "
          f"onnxruntime {ort.__version__}; load average {load()} at start")
    t0 = time.perf_counter()
    model, fq, int8, cfg = build(args.shape)
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="gf_latency_") as tmp:
        reports = {}
        for name, m in (("fp32", model), ("int8", fq)):
            t = time.perf_counter()
            reports[name] = export_onnx(m, Path(tmp) / name, cfg=cfg, check=True)
            c = reports[name].check
            exact = c.get("fp64_agreement")  # random weights: one rounding step can flip later tokens
            floor = (f" (against fp64 arithmetic: export {100 * exact['export']:.1f}%, PyTorch "
                     f"{100 * exact['pytorch']:.1f}%)" if exact else "")
            print(f"ONNX {name} export + check: {time.perf_counter() - t:.1f} s; check: max |logit diff| "
                  f"{c['max_abs_diff']:.2e}, argmax agreement {100 * c['argmax_agreement']:.1f}%{floor}", flush=True)
        from dataclasses import asdict

        engines = {  # our models go through `gptforge generate`'s own backend (a TorchBackend per call)
            "torch fp32": model,
            "torch int8": int8,
            "ORT fp32": OrtBackend(Path(tmp) / "fp32" / "model.onnx", asdict(reports["fp32"]), threads=threads),
            "ORT int8": OrtBackend(Path(tmp) / "int8" / "model.onnx", asdict(reports["int8"]), threads=threads),
        }
        print(f"setup {time.perf_counter() - t0:.0f} s; {args.shape}: {n_params / 1e6:.1f} M parameters; ORT int8 "
              f"GEMMs: {engines['ORT int8'].int8_gemm}; timing (load average {load()})", flush=True)

        times: dict[str, dict[int, list[float]]] = {e: {b: [] for b in batches} for e in engines}
        tokens: dict[str, dict[int, torch.Tensor]] = {e: {} for e in engines}
        for b in batches:
            for be in engines.values():
                for _ in range(args.warmup):
                    run_once(be, b, args)
            for _ in range(args.iters):  # interleaved: every engine once per round
                for e, be in engines.items():
                    dt, toks = run_once(be, b, args)
                    times[e][b].append(dt)
                    tokens[e][b] = toks
            print(f"  batch {b}: " + ", ".join(f"{e} {statistics.mean(times[e][b]) * 1e3:.0f} ms"
                                               for e in engines) + f" (load {load()})", flush=True)

    mean = {e: {b: statistics.mean(v) * 1e3 for b, v in d.items()} for e, d in times.items()}
    print(f"\n{args.shape} ({n_params / 1e6:.1f} M parameters), input {args.input} tokens -> {args.output} generated, "
          f"greedy; mean ms per call over {args.iters} calls after {args.warmup} warm-up; {threads} threads")
    print("| batch | torch fp32 | torch int8 | ORT fp32 | ORT int8 | ORT/torch fp32 | ORT/torch int8 | "
          "int8/fp32 torch | int8/fp32 ORT |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        tf, ti, of, oi = (mean[e][b] for e in engines)
        print(f"| {b} | {tf:.0f} | {ti:.0f} | {of:.0f} | {oi:.0f} | {tf / of:.2f}x | {ti / oi:.2f}x | "
              f"{tf / ti:.2f}x | {of / oi:.2f}x |")
    print("(ratios are speed-ups: old time / new time; > 1 means the second-named engine is faster)")

    def agree(a: str, c: str) -> str:
        same = sum(int((tokens[a][b] == tokens[c][b]).sum()) for b in batches)
        total = sum(tokens[a][b].numel() for b in batches)
        return f"{100 * same / total:.1f}%"

    # Random weights give near-tie logits (top two within ~0.01), so INT8 engines, whose sums run
    # in different orders, can pick different tokens; their fidelity is the export check above.
    print(f"generated tokens equal, torch fp32 vs ORT fp32: {agree('torch fp32', 'ORT fp32')}")
    if args.shape == "345M":
        print("the reference (Paddle Inference, 1 GPU, CUDA 11.6), ms FP16/INT8: " + ", ".join(
            f"bs{b} {v[0]}/{v[1]}" for b, v in REFERENCE_345M.items()))
    if args.kernels:
        kernel_table(threads)
    print(f"\nload average at end: {load()}; total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
