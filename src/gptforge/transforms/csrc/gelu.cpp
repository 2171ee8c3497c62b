// GELU with the tanh approximation for the decode backend (gptforge, issues #30 / #32):
// 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as x / (1 + exp(-2u)) (the same
// function: 0.5 (1 + tanh(u)) = sigmoid(2u)), one exponential and one division per element.
//
// ATen's tanh-GELU spends ~4 ns per element and thread here (a vectorized tanh accurate to 1 ulp),
// 2-4% of a 64-row decode step; this one 4.3x less at 64 rows
// (benchmarks/results/2026-11-27-gelu-attention-copies.md). It is within a few float32
// ulps of the exact function (the exponential: 2^n times a degree-7 Taylor polynomial of e^r on
// |r| <= ln2/2, truncation error < 1e-8 relative) and gives the same bits on every path: the
// vector lanes and the scalar code run the same operations (fused multiply-adds where one is
// written, one rounding each), and an element's result never depends on where it sits, so a
// row's bits do not depend on the rows beside it (batch invariance).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_isa.h"
#include "kernels.h"

namespace {

constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kKappa = 0.044715f;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2Hi = 0.693145751953125f;  // ln 2 split: n * kLn2Hi is exact for |n| < 2^9
constexpr float kLn2Lo = 1.428606765330187e-06f;
constexpr float kExpMin = -87.0f, kExpMax = 88.0f;  // 2^n stays a normal float
// 1/k! for k = 7 .. 0: e^r = ((..(c7 r + c6) r + ..) r + c0
constexpr float kC[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

float gelu_scalar(float x) {
  const float x2 = x * x;
  const float u = x * std::fma(kBeta * kKappa, x2, kBeta);
  const float t = std::min(kExpMax, std::max(kExpMin, -2.f * u));
  const float n = std::nearbyint(t * kLog2e);
  const float r = std::fma(n, -kLn2Lo, std::fma(n, -kLn2Hi, t));
  float p = kC[0];
  for (int i = 1; i < 8; ++i) p = std::fma(p, r, kC[i]);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x / (1.f + p * scale);
}

__attribute__((target("avx2,fma"))) __m256 gelu8(__m256 x) {
  const __m256 x2 = _mm256_mul_ps(x, x);
  const __m256 u = _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_set1_ps(kBeta * kKappa), x2, _mm256_set1_ps(kBeta)));
  const __m256 t = _mm256_min_ps(_mm256_set1_ps(kExpMax),
                                 _mm256_max_ps(_mm256_set1_ps(kExpMin), _mm256_mul_ps(_mm256_set1_ps(-2.f), u)));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), t));
  __m256 p = _mm256_set1_ps(kC[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kC[i]));
  const __m256 scale =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_mul_ps(p, scale)));
}

__attribute__((target("avx2,fma"))) void gelu_avx2(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, gelu8(_mm256_loadu_ps(x + i)));
  if (i < n) {  // the tail through the same vector code
    float in[8] = {0.f}, out[8];
    std::copy(x + i, x + n, in);
    _mm256_storeu_ps(out, gelu8(_mm256_loadu_ps(in)));
    std::copy(out, out + (n - i), y + i);
  }
}

void gelu_run(const float* x, float* y, int64_t n, int64_t isa) {
  if (isa > 0) return gelu_avx2(x, y, n);
  for (int64_t i = 0; i < n; ++i) y[i] = gelu_scalar(x[i]);
}

}  // namespace

namespace gptforge_wo {

at::Tensor gelu_tanh(const at::Tensor& input, int64_t isa) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.device().is_cpu(), "gelu_tanh: a float32 CPU tensor");
  const at::Tensor x = input.contiguous();
  TORCH_CHECK(isa == 0 || gptforge_wo::cpu_has(gptforge_wo::kAvx2), "this CPU cannot run the AVX2 path");
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // A batch-1 step's 3072 elements stay on one thread (waking the other costs more than they take).
  at::parallel_for(0, x.numel(), 16384, [&](int64_t i0, int64_t i1) { gelu_run(xp + i0, yp + i0, i1 - i0, isa); });
  return y;
}

}  // namespace gptforge_wo

TORCH_LIBRARY_FRAGMENT(gptforge_wo, m) {
  m.def("gelu_tanh(Tensor x, int isa) -> Tensor", &gptforge_wo::gelu_tanh);
}
