"""INT8 vs fp32 decoding speed at batch 1 and weight bytes, on the 345M preset shape.

    .venv/bin/python benchmarks/int8_speed.py                 # 345M, prompt 32, 32 new tokens
    .venv/bin/python benchmarks/int8_speed.py --threads 1 --preset 124M
    .venv/bin/python benchmarks/int8_speed.py --kernel-choice   # split vs plain (and ORT) only

Random weights (the reference's init), activation scales calibrated PTQ-style on one random
batch, every block Linear quantized (int8 per-channel weights, static int8 activations, PACT)
and the tied embedding / LM head int8 per row. Both models decode greedily through the same
step loop `gptforge generate` uses (`TorchBackend`, KV cache, last-position logits); the fp32
peer runs with and without oneDNN-packed weights (`Generation.fast_cpu_decode`, the default)
and the faster of the two is the reference for the ratio. The models decode in interleaved
rounds (fp32 packed, fp32 plain, int8, repeated) so that load from other processes hits all. Reported: median per-token decode
time after the prompt, prompt (prefill) time, state-dict bytes, and the INT8 model's logits
against the fake-quant model it came from (SQNR, greedy agreement).

`--kernel-choice`: the INT8 paths `transforms/cpu_kernels.py` chooses between, each forced, on one
Linear: fbgemm `split` vs `plain` and onnxruntime's fused GEMM per storage vs the unfused QDQ
graph: time, error against exact int8 arithmetic, what the probes say, and what `auto` picks,
with the CPU (model, flags) and the load average.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch


def decode_times(model, prompt: torch.Tensor, new_tokens: int, prepack: bool) -> tuple[float, list[float]]:
    """(prefill seconds, per-token seconds) of a greedy decode through the generation backend."""
    from gptforge.generate.backend import TorchBackend

    n = prompt.shape[1]
    with TorchBackend(model, prepack=prepack) as b:
        cache = b.new_cache(1, n + new_tokens + 1)
        t0 = time.perf_counter()
        logits = b.step(prompt, torch.arange(n)[None], None, cache)
        prefill = time.perf_counter() - t0
        tok = logits.argmax(-1, keepdim=True)
        steps = []
        for i in range(new_tokens):
            t = time.perf_counter()
            logits = b.step(tok, torch.tensor([[n + i]]), None, cache)
            tok = logits.argmax(-1, keepdim=True)
            steps.append(time.perf_counter() - t)
    return prefill, steps


def _median_ms(f, n: int = 20) -> float:
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def kernel_table(K: int = 1024, N: int = 4096, rows=(1, 8, 128)) -> None:
    """The INT8 options on this CPU for one Linear: time and error against exact int8 arithmetic."""
    import torch.nn.functional as F

    from gptforge.config.schema import QuantizationConfig
    from gptforge.transforms.int8 import Int8Linear
    from gptforge.transforms.quant import QuantLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N)
    fq = QuantLinear.from_linear(lin, QuantizationConfig(enable=True, activation_quantize_type="abs_max")).eval()
    ours = Int8Linear.from_quant(fq)
    packed_fp32 = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 1)
    w_deq = ours.dequantized_weight()
    qlin = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(copy.deepcopy(lin)), {torch.nn.Linear},
                                                  dtype=torch.qint8)[0]
    plain_op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    opts = {
        "fp32 F.linear (MKL)": lambda x: F.linear(x, lin.weight, lin.bias),
        "fp32 oneDNN packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed_fp32, lin.bias, "none", [], ""),
        "fbgemm dynamic (quantize_dynamic, 7-bit act.)": lambda x: qlin(x),
        "fbgemm static, zero point 128": lambda x: plain_op(x, float(x.abs().max()) / 127, 128, ours.packed())
        + lin.bias,
        "torch._weight_int8pack_mm": lambda x: torch.ops.aten._weight_int8pack_mm(x, ours.weight, ours.weight_scale)
        + lin.bias,
        "gptforge Int8Linear (fbgemm, auto path)": lambda x: ours(x),
    }
    try:
        from torchao.quantization import (
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
            quantize_,
        )

        for name, conf in (("torchao int8 weight-only", Int8WeightOnlyConfig()),
                           ("torchao int8 dynamic (W8A8)", Int8DynamicActivationInt8WeightConfig())):
            m = copy.deepcopy(lin)
            quantize_(m, conf)
            opts[name] = lambda x, m=m: m(x)
    except Exception as e:  # noqa: BLE001 - an optional extra
        print(f"(torchao not measured: {type(e).__name__}: {e})")
    print(f"\nOne Linear {K} -> {N}: median ms per call (error: SQNR vs exact int8 arithmetic "
          "of the same per-channel weights and per-tensor activations)")
    print("| kernel | " + " | ".join(f"rows {m}" for m in rows) + " | SQNR (rows 8) |")
    print("|---|" + "---:|" * (len(rows) + 1))
    for name, f in opts.items():
        cells = []
        for m in rows:
            x = torch.randn(m, K)
            with torch.no_grad():
                cells.append(f"{_median_ms(lambda f=f, x=x: f(x), 10 if m > 8 else 30):.3f}")
        x = torch.randn(8, K)
        with torch.no_grad():
            exact = F.linear(fq.quantize_input(x).double(), w_deq.double(), lin.bias.double())
            err = f"{sqnr_db(exact, f(x)):.1f} dB" if "fp32" not in name else "(float)"
        print(f"| {name} | " + " | ".join(cells) + f" | {err} |")


def kernel_choice_table(K: int = 1024, N: int = 4096, rows=(1, 8, 128), rounds: int = 3) -> None:
    """Each INT8 path forced on one Linear K -> N: median ms per call (best of `rounds`
    interleaved rounds, so that load from other processes hits every path alike) and error
    against exact int8 arithmetic of the same integers."""
    import torch.nn.functional as F

    from gptforge.config.schema import QuantizationConfig
    from gptforge.transforms import cpu_kernels
    from gptforge.transforms.int8 import Int8Linear, kernel_path, native_ready, set_kernel
    from gptforge.transforms.quant import QuantLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False)
    fq = QuantLinear.from_linear(lin, QuantizationConfig(enable=True, activation_quantize_type="abs_max")).eval()
    w_deq = Int8Linear.from_quant(fq).dequantized_weight().double()
    g = torch.Generator().manual_seed(1)
    inputs = {"randn": torch.randn(8, K, generator=g),
              "full-range": (torch.randint(-127, 128, (8, K), generator=g).float() + 0.3)}  # every byte used
    timing = {m: torch.randn(m, K, generator=g) for m in rows}
    load0 = os.getloadavg()

    def error(y: torch.Tensor, x: torch.Tensor) -> str:
        exact = F.linear(fq.quantize_input(x).double(), w_deq)
        return f"{float((y.double() - exact).abs().max() / exact.abs().max()):.1e}"

    paths: dict[str, tuple[str, object]] = {"fp32 F.linear (the float peer)": ("(float)", lambda x: F.linear(x, lin.weight))}
    fb_exact = cpu_kernels.fbgemm_plain_is_exact()
    for kernel in ("split", "plain"):
        mod = set_kernel(Int8Linear.from_quant(fq), kernel)
        exact = "yes" if kernel == "split" else {True: "yes", False: "no", None: "n/a"}[fb_exact]
        paths[f"fbgemm `{kernel}` (Int8Linear)"] = (exact, mod)
    if native_ready():
        paths["gptforge `native` (Int8Linear)"] = ("yes", set_kernel(Int8Linear.from_quant(fq), "native"))
    else:
        print("(gptforge's own kernels do not run a vector path here: `native` not measured)")
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
        print("(onnxruntime not installed: its kernels not measured)")
    if ort is not None:
        ref = Int8Linear.from_quant(fq)
        w_int, ws = ref.weight.numpy().T.copy(), ref.weight_scale.numpy()

        def ort_path(dtype: str, fused: bool):
            so = ort.SessionOptions()
            so.log_severity_level = 3
            so.intra_op_num_threads = torch.get_num_threads()
            if not fused:
                so.add_session_config_entry("session.disable_quant_qdq", "1")
            sessions = {}

            def run(x: torch.Tensor) -> torch.Tensor:
                step = max(float(x.abs().max()) / 127, 1e-12)  # abs_max activations, as the layer
                if step not in sessions:
                    sessions[step] = ort.InferenceSession(cpu_kernels.one_linear_qdq_graph(w_int, ws, step, dtype),
                                                          so, providers=["CPUExecutionProvider"])
                return torch.from_numpy(sessions[step].run(None, {"x": x.numpy()})[0])
            return run

        for dtype in ("uint8", "int8"):
            for fused in (True, False):
                exact = "yes" if not fused or cpu_kernels.ort_gemm_is_exact(dtype) else "no"
                paths[f"onnxruntime {dtype} storage, {'fused' if fused else 'unfused'}"] = (exact, ort_path(dtype, fused))

    best: dict[tuple[str, int], float] = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # forcing plain where it saturates warns
        for _ in range(rounds):
            for name, (_, f) in paths.items():
                for m, x in timing.items():
                    t = _median_ms(lambda f=f, x=x: f(x), 10 if m > 8 else 30)
                    best[name, m] = min(best.get((name, m), t), t)
        errors = {name: [error(f(x), x) if exact != "(float)" else "-" for x in inputs.values()]
                  for name, (exact, f) in paths.items()}
    load1 = os.getloadavg()
    print(f"\nmachine: {cpu_kernels.describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average before {load0[0]:.2f} / after {load1[0]:.2f} (1 min)")
    print(f"auto picks: {kernel_path()}; onnxruntime " + ", ".join(
        f"{d} storage {cpu_kernels.ort_int8_gemm(d)}" for d in cpu_kernels.ort_probes()))
    print(f"\nOne Linear {K} -> {N}, each path forced: median ms per call (best of {rounds} interleaved rounds); "
          "error = max |y - exact| / max |exact| against exact int8 arithmetic of the same integers")
    print("| path | exact (probe) | " + " | ".join(f"rows {m}" for m in rows) + " | error randn | error full-range |")
    print("|---|---|" + "---:|" * (len(rows) + 2))
    for name, (exact, _) in paths.items():
        print(f"| {name} | {exact} | " + " | ".join(f"{best[name, m]:.3f}" for m in rows) + " | "
              + " | ".join(errors[name]) + " |")


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    import math

    noise = (test.double() - ref.double()).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.double().pow(2).sum().item() / noise)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
        return f"{name}, {torch.get_num_threads()} threads"
    except (OSError, subprocess.CalledProcessError):
        return f"?, {torch.get_num_threads()} threads"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="345M")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved decode rounds; each model's best median is kept")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-kernels", action="store_true", help="skip the one-Linear table of INT8 options")
    ap.add_argument("--kernel-choice", action="store_true",
                    help="only the forced INT8 paths (fbgemm split/plain, onnxruntime fused/unfused) on one Linear")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernel_choice:
        kernel_choice_table()
        return 0

    from gptforge.compress.int8_convert import compare_logits, state_bytes
    from gptforge.compress.ptq import calibrate
    from gptforge.config import load_config
    from gptforge.config.schema import QuantizationConfig
    from gptforge.model import build_model
    from gptforge.transforms.cpu_kernels import describe
    from gptforge.transforms.int8 import convert_model, fast_kernel_available
    from gptforge.transforms.quant import quantize_model

    print(f"machine: {cpu_name()}; torch {torch.__version__}; fbgemm int8 kernel: {fast_kernel_available()}; "
          f"{describe()}; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    cfg = load_config(overrides=[f"Model.preset={args.preset}", "Model.hidden_dropout_prob=0",
                                 "Model.attention_probs_dropout_prob=0"])
    torch.manual_seed(0)
    model = build_model(cfg.Model).eval()
    vocab = min(cfg.Model.vocab_size, 50257)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=g)
    fp32_bytes = state_bytes(model)

    q = QuantizationConfig(enable=True, weight_quantize_type="channel_wise_abs_max",
                           activation_preprocess_type="PACT", quantize_embedding=True)
    int8 = quantize_model(copy.deepcopy(model), q)
    calibrate(int8, [torch.randint(0, vocab, (2, 128), generator=g)], "abs_max")
    ids = torch.randint(0, vocab, (1, 64), generator=g)
    floor = compare_logits(copy.deepcopy(int8).double(), int8, ids)  # the fake-quant model in fp64 vs fp32
    fake = copy.deepcopy(int8)
    convert_model(int8)
    int8_bytes = state_bytes(int8)
    check = compare_logits(fake, int8, ids)
    del fake
    decode_times(int8, prompt, 2, True)  # the first call packs the int8 weights for fbgemm (one-off)

    # Interleaved rounds: load from other processes hits every model alike.
    runs: dict[str, list] = {"fp32 (packed)": [], "fp32 (plain)": [], "int8": []}
    for _ in range(args.repeats):
        runs["fp32 (packed)"].append(decode_times(model, prompt, args.new_tokens, True))
        runs["fp32 (plain)"].append(decode_times(model, prompt, args.new_tokens, False))
        runs["int8"].append(decode_times(int8, prompt, args.new_tokens, True))
    results = {k: (min(r[0] for r in v), min(statistics.median(r[1]) for r in v)) for k, v in runs.items()}

    fp32_best = min(v[1] for k, v in results.items() if k.startswith("fp32"))
    print(f"\n{args.preset}, batch 1, prompt {args.prompt}, {args.new_tokens} new tokens, best of {args.repeats} "
          "interleaved rounds")
    print("| model | decode ms/token | tokens/s | prefill ms | weight MB | vs fp32 best |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (prefill, step) in results.items():
        mb = (int8_bytes if name == "int8" else fp32_bytes) / 1e6
        print(f"| {name} | {step * 1e3:.1f} | {1 / step:.2f} | {prefill * 1e3:.0f} | {mb:.0f} | "
              f"{fp32_best / step:.2f}x |")
    print(f"\nINT8 decode speed-up over the faster fp32 path: {fp32_best / results['int8'][1]:.2f}x (goal >= 1.5x)")
    print(f"INT8 weight bytes: {int8_bytes / fp32_bytes:.1%} of fp32 (goal <= 30%)")
    print(f"INT8 vs fake-quant logits on 64 tokens: SQNR {check['sqnr_db']:.1f} dB, greedy agreement "
          f"{100 * check['argmax_agreement']:.1f}%; the fake-quant model in fp32 vs fp64 (its own rounding "
          f"floor): {floor['sqnr_db']:.1f} dB, {100 * floor['argmax_agreement']:.1f}% (random weights: chaotic)")
    if not args.no_kernels:
        kernel_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
