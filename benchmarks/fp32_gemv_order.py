"""A batch-1 fp32 GEMV that is bit-identical to the batch-invariant packed Linears (issue #32).

    PYTHONPATH=src:/tmp/llama_b .venv/bin/python benchmarks/fp32_gemv_order.py [--threads 1] [--steps 32]

The decode path packs every Linear and the tied head with oneDNN's small-batch layout
(`generate/backend.py`, `PACKED_LAYOUT_ROWS`): each row's result is the same whatever the number
of rows, which makes serving bit-identical to `generate`, but at one row that kernel streams the
weights ~40% slower than a GEMV (decode_profile / results 2026-11-25-decode-overhead.md). This
script shows the order that kernel sums in on this machine, row by row: the K inputs in chunks of
1024, each chunk a sequential fused multiply-add chain from zero, the chunk sums added in order,
then the bias. A GEMV that keeps that order per output (vectorized across 64 outputs, one
broadcast input at a time, so every lane is its own sequential chain) gives the same bits at a
GEMV's speed. The kernel here is a prototype (AVX2 + FMA, built with `load_inline` into a
temporary directory, OpenMP across blocks of 64 outputs): it belongs with the native kernels of
`transforms/`, behind a one-time exactness probe against the packed kernel.

Printed: (1) the pure-PyTorch emulation of the order against the packed kernel; (2) per Linear
shape of the 124M model, bit-equality and the calling thread's CPU milliseconds of the packed
kernel, `F.linear` and the prototype; (3) batch-1 greedy decode of the 124M shape with the
stock backend and with the prototype serving one-row products, steps alternated in one process,
the logits compared bit for bit at every step, and llama.cpp f32 on our GGUF export when
llama-cpp-python is importable.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_speed import cpu_name  # noqa: E402 - the shared CPU line

CHUNK = 1024
BLOCK = 64

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>

// y[n] = sum over chunks c of (sequential fma chain over k in c) + b[n]; wb: [N/64, K, 64].
torch::Tensor gemv(torch::Tensor wb, torch::Tensor x, c10::optional<torch::Tensor> b, int64_t N, int64_t chunk) {
  const int64_t NB = wb.size(0), K = wb.size(1);
  const float* w = wb.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* bp = b.has_value() ? b->data_ptr<float>() : nullptr;
  auto out = torch::empty({N}, x.options());
  float* o = out.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < NB; ++nb) {
    __m256 tot[8], acc[8];
    for (int64_t c0 = 0; c0 < K; c0 += chunk) {
      for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_ps();
      const int64_t c1 = std::min(K, c0 + chunk);
      const float* row = w + (nb * K + c0) * 64;
      for (int64_t k = c0; k < c1; ++k, row += 64) {
        const __m256 xk = _mm256_set1_ps(xp[k]);
        for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(_mm256_loadu_ps(row + 8 * v), xk, acc[v]);
      }
      for (int v = 0; v < 8; ++v) tot[v] = c0 == 0 ? acc[v] : _mm256_add_ps(tot[v], acc[v]);
    }
    alignas(32) float buf[64];
    for (int v = 0; v < 8; ++v) _mm256_store_ps(buf + 8 * v, tot[v]);
    const int64_t n0 = nb * 64, n = std::min<int64_t>(64, N - n0);
    for (int64_t j = 0; j < n; ++j) o[n0 + j] = bp ? buf[j] + bp[n0 + j] : buf[j];
  }
  return out;
}
"""


def build_kernel(tmp: str):
    from torch.utils.cpp_extension import load_inline

    return load_inline("gf_fp32_gemv_proto", cpp_sources=SOURCE, functions=["gemv"],
                       extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       build_directory=tmp, verbose=False)


def block(w: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N/64), K, 64]: for each input k, 64 consecutive outputs' weights."""
    n, k = w.shape
    nb = -(-n // BLOCK)
    padded = torch.zeros(nb * BLOCK, k)
    padded[:n] = w
    return padded.view(nb, BLOCK, k).transpose(1, 2).contiguous()


def packed(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, 8)


def linear_packed(x, p, b):
    return torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")


def emulate(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The order in pure PyTorch (one vector op per input: slow, only for the check)."""
    total = None
    for c0 in range(0, w.shape[1], CHUNK):
        acc = torch.zeros(w.shape[0])
        for k in range(c0, min(w.shape[1], c0 + CHUNK)):
            acc = torch.addcmul(acc, w[:, k], x[k].expand(w.shape[0]))
        total = acc if total is None else total + acc
    return total + b if b is not None else total


def cpu_ms(fn, n: int = 9) -> float:
    fn()
    ts = []
    for _ in range(n):
        c = time.thread_time()
        fn()
        ts.append(time.thread_time() - c)
    return statistics.median(ts) * 1e3


SHAPES = ((2304, 768, True), (768, 768, True), (3072, 768, True), (768, 3072, True), (50304, 768, False))


def shapes_table(kern) -> None:
    g = torch.Generator().manual_seed(0)
    print("\n| weight [N, K] | emulated order = packed | prototype = packed | packed ms | F.linear ms | "
          "prototype ms |")
    print("|---|:---:|:---:|---:|---:|---:|")
    for n, k, has_bias in SHAPES:
        reps = 1 if n > 10000 else 12  # 12 layers' worth: the weights never sit in cache
        ws = [torch.randn(n, k, generator=g) * 0.02 for _ in range(reps)]
        b = torch.randn(n, generator=g) * 0.1 if has_bias else None
        ps, bs = [packed(w) for w in ws], [block(w) for w in ws]
        xs = torch.randn(4, k, generator=g)
        same = all(torch.equal(kern.gemv(bs[0], x, b, n, CHUNK), linear_packed(x[None], ps[0], b)[0]) for x in xs)
        emu = torch.equal(emulate(ws[0], xs[0], b), linear_packed(xs[:1], ps[0], b)[0]) if n < 10000 else None
        x1 = xs[:1]
        t_p = cpu_ms(lambda x1=x1, b=b, ps=ps: [linear_packed(x1, p, b) for p in ps])
        t_f = cpu_ms(lambda x1=x1, b=b, ws=ws: [F.linear(x1, w, b) for w in ws])
        t_g = cpu_ms(lambda x1=x1, b=b, bs=bs, n=n: [kern.gemv(q, x1[0], b, n, CHUNK) for q in bs])
        print(f"| {n} x {k} (x{reps}) | {'-' if emu is None else emu} | {same} | {t_p:.1f} | {t_f:.1f} | {t_g:.1f} |",
              flush=True)


def patch_one_row(backend, model, kern, state: dict) -> None:
    """Route one-row products of the packed Linears and the head through the prototype while
    `state["on"]`; other row counts (and `on` False) keep the packed kernel."""
    for mod in backend._patched:
        if not isinstance(mod, torch.nn.Linear):
            continue
        orig, wb, n = mod.forward, block(mod.weight.detach()), mod.out_features

        def fwd(x, _orig=orig, _wb=wb, _n=n, _b=mod.bias):
            if state["on"] and x.numel() == x.shape[-1]:
                return kern.gemv(_wb, x.reshape(-1), _b, _n, CHUNK).view(*x.shape[:-1], _n)
            return _orig(x)
        mod.forward = fwd
    head_wb, head_n, project = block(model.wte.weight.detach()), model.wte.weight.shape[0], backend.project

    def proj(h, _project=project):
        if state["on"] and h.shape[0] == 1:
            return kern.gemv(head_wb, h.reshape(-1), None, head_n, CHUNK)[None]
        return _project(h)
    backend.project = proj


def end_to_end(kern, args) -> None:
    from gptforge.config import load_config
    from gptforge.generate.backend import TorchBackend
    from gptforge.model import build_model

    cfg = load_config(overrides=["Model.preset=124M", "Data.tokenizer=gpt2", "Model.hidden_dropout_prob=0",
                                 "Model.attention_probs_dropout_prob=0"])
    torch.manual_seed(0)
    model = build_model(cfg.Model).eval()
    prompt = torch.randint(0, 50257, (1, args.prompt), generator=torch.Generator().manual_seed(2))
    state = {"on": False}
    llm = llama(model, cfg, args)
    times: dict[str, list[float]] = {"packed (stock)": [], "prototype GEMV": []}
    wall: dict[str, list[float]] = {k: [] for k in times}
    if llm is not None:
        times["llama.cpp f32"], wall["llama.cpp f32"] = [], []
    with torch.inference_mode(), TorchBackend(model) as be:
        caches = {k: be.new_cache(1, args.prompt + args.steps + 2) for k in ("packed (stock)", "prototype GEMV")}
        toks, last = {}, {}
        for k, cache in caches.items():
            last[k] = be.step(prompt, torch.arange(args.prompt)[None], None, cache)
            toks[k] = last[k].argmax(-1, keepdim=True)
        patch_one_row(be, model, kern, state)
        if llm is not None:
            llm.reset()
            llm.eval(prompt[0].tolist())
        identical = True
        for i in range(args.steps):
            pos = torch.tensor([[args.prompt + i]])
            for k, cache in caches.items():
                state["on"] = k == "prototype GEMV"
                t, c = time.perf_counter(), time.thread_time()
                last[k] = be.step(toks[k], pos, None, cache)
                toks[k] = last[k].argmax(-1, keepdim=True)
                times[k].append(time.thread_time() - c)
                wall[k].append(time.perf_counter() - t)
            identical &= torch.equal(last["packed (stock)"], last["prototype GEMV"])
            if llm is not None:
                t, c = time.perf_counter(), time.thread_time()
                llm.eval([int(toks["packed (stock)"])])
                times["llama.cpp f32"].append(time.thread_time() - c)
                wall["llama.cpp f32"].append(time.perf_counter() - t)
    print(f"\nbatch-1 greedy decode, 124M shape, prompt {args.prompt}, {args.steps} steps alternated, "
          f"{torch.get_num_threads()} thread(s); logits bit-identical at every step: {identical}")
    print("\n| engine | ms/token (median, wall) | tokens/s (wall) | calling thread's CPU ms/token |")
    print("|---|---:|---:|---:|")
    for k in times:
        w, c = statistics.median(wall[k]) * 1e3, statistics.median(times[k]) * 1e3
        print(f"| {k} | {w:.1f} | {1e3 / w:.1f} | {c:.1f} |")


def llama(model, cfg, args):
    """llama.cpp on our f32 GGUF export, or None where llama-cpp-python is absent."""
    try:
        import llama_cpp
    except ImportError:
        print("(llama-cpp-python not importable: no llama.cpp row)")
        return None
    from gptforge.data.tokenizer import gpt2_tokenizer
    from gptforge.export.gguf import save_gguf

    path = Path(tempfile.mkdtemp(prefix="gemv-order-")) / "f32.gguf"
    save_gguf(model, path, gpt2_tokenizer(), "f32", model_cfg=cfg.Model)
    return llama_cpp.Llama(str(path), n_ctx=args.prompt + args.steps + 8, n_batch=args.prompt,
                           n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads(),
                           verbose=False, seed=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    args = ap.parse_args()
    flags = Path("/proc/cpuinfo").read_text(encoding="utf-8") if os.path.exists("/proc/cpuinfo") else ""
    if " avx2 " not in flags or " fma " not in flags:
        print("the prototype needs AVX2 + FMA")
        return 2
    torch.set_num_threads(args.threads)
    print(f"machine: {cpu_name()}, torch {torch.__version__}, {args.threads} thread(s); "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="gf-gemv-") as tmp:
        kern = build_kernel(tmp)
        shapes_table(kern)
        end_to_end(kern, args)
    print(f"\nload average at the end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
