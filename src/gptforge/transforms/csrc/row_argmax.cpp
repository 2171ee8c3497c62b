// Each row's argmax as torch.argmax gives it (the first maximum; a NaN counts as the maximum, the
// first NaN wins), for the sampler's greedy choice. torch's argmax reduction is not vectorized:
// ~120 us for one row of GPT-2's 50257 scores, about a step's whole sampling at batch 1; a vector
// maximum then the first lane equal to it reads the row twice in ~10 us. Exact by construction: it
// only compares floats.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_isa.h"

namespace {

using gptforge_wo::cpu_has;
using gptforge_wo::kAvx2;

int64_t first_max_scalar(const float* x, int64_t V) {
  if (std::isnan(x[0])) return 0;
  int64_t best = 0;
  float m = x[0];
  for (int64_t i = 1; i < V; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > m) m = x[i], best = i;
  }
  return best;
}

__attribute__((target("avx2"))) int64_t first_max_avx2(const float* x, int64_t V) {
  if (V < 16) return first_max_scalar(x, V);
  __m256 mx = _mm256_loadu_ps(x), unord = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
  int64_t i = 8;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
  bool nan = _mm256_movemask_ps(unord) != 0;
  for (int64_t t = i; t < V; ++t) {
    nan = nan || std::isnan(x[t]);
    m = x[t] > m ? x[t] : m;
  }
  if (nan) return first_max_scalar(x, V);  // the first NaN's index
  const __m256 mv = _mm256_set1_ps(m);
  for (i = 0; i + 8 <= V; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < V; ++i)
    if (x[i] == m) return i;
  return 0;  // not reached: m is one of the row's values
}

// x: contiguous fp32 [R, V], V > 0 -> int64 [R].
at::Tensor row_argmax(const at::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "x: contiguous fp32 [rows, V > 0]");
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run ISA path ", isa);
  const int64_t R = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  auto first = isa >= kAvx2 ? first_max_avx2 : first_max_scalar;
  at::parallel_for(0, R, std::max<int64_t>(1, 262144 / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = first(xp + r * V, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptforge_wo, m) { m.def("row_argmax(Tensor x, int isa) -> Tensor", &row_argmax); }
