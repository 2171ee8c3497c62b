// One-row fp32 GEMV in the summation order of the batch-invariant oneDNN kernel (issue #32).
//
// The decode backend runs every Linear through oneDNN's small-batch packed layout because a
// row's result there never depends on how many rows share the product (serve = generate, bit
// for bit). At one row that kernel is ~40% slower than a GEMV. Per output it sums in a simple,
// fixed order: the K inputs in chunks of 1024, each chunk a sequential fused multiply-add chain
// from zero, the chunk sums added in order, the bias last (benchmarks/fp32_gemv_order.py). This
// kernel keeps that order exactly: the weights are stored in blocks of 64 outputs x K (for each
// input k, 64 consecutive outputs' weights), one input is broadcast at a time and each vector
// lane is one output's own sequential FMA chain. FMA rounds once, whatever the vector width, so
// the scalar, AVX2 and AVX-512 paths give the same bits; so does any thread count, since one
// output is always computed by one task. The caller checks the bits against the packed kernel
// once per layer before using it (generate/backend.py): this file only reproduces an order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_isa.h"
#include "kernels.h"

namespace {

using gptforge_wo::cpu_has;
using gptforge_wo::kAvx2;
using gptforge_wo::kAvx512;

constexpr int64_t kBlock = 64;   // outputs per weight block
constexpr int64_t kChunk = 1024;  // inputs per FMA chain (the packed kernel's)

// out[0..63] = the block's 64 sums (bias not added); w: [K, 64] of one block.
void block_scalar(const float* w, const float* x, int64_t K, float* out) {
  float tot[kBlock], acc[kBlock];
  for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
    std::fill(acc, acc + kBlock, 0.f);
    const int64_t c1 = std::min(K, c0 + kChunk);
    for (int64_t k = c0; k < c1; ++k)
      for (int64_t j = 0; j < kBlock; ++j) acc[j] = std::fma(w[k * kBlock + j], x[k], acc[j]);
    for (int64_t j = 0; j < kBlock; ++j) tot[j] = c0 == 0 ? acc[j] : tot[j] + acc[j];
  }
  std::copy(tot, tot + kBlock, out);
}

__attribute__((target("avx2,fma"))) void block_avx2(const float* w, const float* x, int64_t K, float* out) {
  __m256 tot[8], acc[8];
  for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
    for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_ps();
    const int64_t c1 = std::min(K, c0 + kChunk);
    const float* row = w + c0 * kBlock;
    for (int64_t k = c0; k < c1; ++k, row += kBlock) {
      const __m256 xk = _mm256_set1_ps(x[k]);
      for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(_mm256_loadu_ps(row + 8 * v), xk, acc[v]);
    }
    for (int v = 0; v < 8; ++v) tot[v] = c0 == 0 ? acc[v] : _mm256_add_ps(tot[v], acc[v]);
  }
  for (int v = 0; v < 8; ++v) _mm256_storeu_ps(out + 8 * v, tot[v]);
}

__attribute__((target("avx512f,avx2,fma"))) void block_avx512(const float* w, const float* x, int64_t K,
                                                              float* out) {
  __m512 tot[4], acc[4];
  for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
    for (int v = 0; v < 4; ++v) acc[v] = _mm512_setzero_ps();
    const int64_t c1 = std::min(K, c0 + kChunk);
    const float* row = w + c0 * kBlock;
    for (int64_t k = c0; k < c1; ++k, row += kBlock) {
      const __m512 xk = _mm512_set1_ps(x[k]);
      for (int v = 0; v < 4; ++v) acc[v] = _mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * v), xk, acc[v]);
    }
    for (int v = 0; v < 4; ++v) tot[v] = c0 == 0 ? acc[v] : _mm512_add_ps(tot[v], acc[v]);
  }
  for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + 16 * v, tot[v]);
}

}  // namespace

// The entry point (kernels.h: the fused decode step calls it directly).
namespace gptforge_wo {

// x: fp32 with K elements (any shape whose last dim is K and one row); wb: [ceil(N/64), K, 64].
at::Tensor fp32_gemv(const at::Tensor& wb, const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t N,
                     int64_t isa) {
  TORCH_CHECK(wb.dim() == 3 && wb.size(2) == kBlock && wb.scalar_type() == at::kFloat && wb.is_contiguous(),
              "wb: contiguous fp32 [blocks, K, 64]");
  const int64_t NB = wb.size(0), K = wb.size(1);
  TORCH_CHECK(N > 0 && (N + kBlock - 1) / kBlock == NB, "N ", N, " does not match ", NB, " blocks");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == K && x.size(-1) == K,
              "x: one contiguous fp32 row of ", K);
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run ISA path ", isa);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias: fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, x.options());
  const float* w = wb.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  auto kernel = isa == kAvx512 ? block_avx512 : isa == kAvx2 ? block_avx2 : block_scalar;
  // ~64K multiply-adds per task; the order inside one output never depends on the split.
  const int64_t grain = std::max<int64_t>(1, 1024 / std::max<int64_t>(1, K));
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float buf[kBlock];
    for (int64_t nb = b0; nb < b1; ++nb) {
      kernel(w + nb * K * kBlock, xp, K, buf);
      const int64_t n0 = nb * kBlock, n = std::min(kBlock, N - n0);
      for (int64_t j = 0; j < n; ++j) o[n0 + j] = bp ? buf[j] + bp[n0 + j] : buf[j];
    }
  });
  return out;
}

}  // namespace gptforge_wo

TORCH_LIBRARY_FRAGMENT(gptforge_wo, m) {
  m.def("fp32_gemv(Tensor wb, Tensor x, Tensor? bias, int N, int isa) -> Tensor", &gptforge_wo::fp32_gemv);
}
