// The LM head screen's candidates (transforms/head_screen.py): the columns where some row's
// approximate logit reaches that row's floor, ascending. In torch that is a compare, a reduction
// over rows and a `nonzero` over the vocabulary (~0.3 ms at GPT-2's 50304 columns on a 2-core
// EPYC, ~3% of a batch-1 step); here one pass that ORs the rows' compares per 8 columns.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"

namespace {

using gptforge_wo::cpu_has;
using gptforge_wo::kAvx2;

void pick_scalar(const float* a, const float* floor, int64_t R, int64_t V, int64_t from, std::vector<int64_t>& out) {
  for (int64_t i = from; i < V; ++i)
    for (int64_t r = 0; r < R; ++r)
      if (a[r * V + i] >= floor[r]) {
        out.push_back(i);
        break;
      }
}

__attribute__((target("avx2"))) void pick_avx2(const float* a, const float* floor, int64_t R, int64_t V,
                                               std::vector<int64_t>& out) {
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    int hit = 0;
    for (int64_t r = 0; r < R; ++r)
      hit |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(a + r * V + i), _mm256_set1_ps(floor[r]), _CMP_GE_OQ));
    while (hit) {
      out.push_back(i + __builtin_ctz(static_cast<unsigned>(hit)));
      hit &= hit - 1;
    }
  }
  pick_scalar(a, floor, R, V, i, out);
}

// approx: contiguous fp32 [R, V]; floor: fp32 [R] -> int64 [C].
at::Tensor screen_candidates(const at::Tensor& approx, const at::Tensor& floor, int64_t isa) {
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == at::kFloat && approx.is_contiguous(),
              "approx: contiguous fp32 [rows, V]");
  TORCH_CHECK(floor.dim() == 1 && floor.scalar_type() == at::kFloat && floor.is_contiguous() &&
                  floor.size(0) == approx.size(0), "floor: fp32 [rows]");
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run ISA path ", isa);
  const int64_t R = approx.size(0), V = approx.size(1);
  std::vector<int64_t> cols;
  if (isa >= kAvx2)
    pick_avx2(approx.data_ptr<float>(), floor.data_ptr<float>(), R, V, cols);
  else
    pick_scalar(approx.data_ptr<float>(), floor.data_ptr<float>(), R, V, 0, cols);
  at::Tensor out = at::empty({static_cast<int64_t>(cols.size())}, approx.options().dtype(at::kLong));
  if (!cols.empty()) std::memcpy(out.data_ptr<int64_t>(), cols.data(), cols.size() * sizeof(int64_t));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptforge_wo, m) {
  m.def("screen_candidates(Tensor approx, Tensor floor, int isa) -> Tensor", &screen_candidates);
}
