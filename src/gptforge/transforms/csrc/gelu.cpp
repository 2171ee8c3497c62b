// GELU with the tanh approximation for the decode backend (gptforge, issues #30 / #32):
// 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as x / (1 + exp(-2u)) (the same
// function: 0.5 (1 + tanh(u)) = sigmoid(2u)), one exponential and one division per element.
//
// ATen's tanh-GELU spends ~4 ns per element and thread here (a vectorized tanh accurate to 1 ulp),
// 2-4% of a 64-row decode step; this one 4.3x less at 64 rows
// (benchmarks/results/2026-11-27-gelu-attention-copies.md). It is within a few float32
// ulps of the exact function (the exponential: exp_poly.h) and gives the same bits on every path: the
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
#include "exp_poly.h"
#include "kernels.h"

namespace {

constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kKappa = 0.044715f;

float gelu_scalar(float x) {
  const float x2 = x * x;
  const float u = x * std::fma(kBeta * kKappa, x2, kBeta);
  return x / (1.f + gptforge_wo::exp_poly(-2.f * u));
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "simd_avx2.inc"

VF gelu8(VF x) {
  const VF u = vmul(x, vfma(vset1(kBeta * kKappa), vmul(x, x), vset1(kBeta)));
  return _mm256_div_ps(x, vadd(vset1(1.f), vexp(vmul(vset1(-2.f), u))));
}

void gelu(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, gelu8(vload(x + i)));
  if (i < n) {  // the tail through the same vector code
    float in[W] = {0.f}, out[W];
    std::copy(x + i, x + n, in);
    vstore(out, gelu8(vload(in)));
    std::copy(out, out + (n - i), y + i);
  }
}
}  // namespace avx2
#pragma GCC pop_options

void gelu_run(const float* x, float* y, int64_t n, int64_t isa) {
  if (isa > 0) return avx2::gelu(x, y, n);
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
