// The optional operands of a weight-only product, checked once for every kernel that takes them.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>

namespace gptforge_wo {

// int8 zeros shaped like the scales ([N, groups]: `zero_shape`) and a float bias [N], each null when absent.
inline void optional_operands(const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias,
                              c10::IntArrayRef zero_shape, int64_t N, const int8_t** zp, const float** bp) {
  *zp = nullptr, *bp = nullptr;
  if (zero.has_value() && zero->defined()) {
    TORCH_CHECK(zero->is_contiguous() && zero->scalar_type() == at::kChar && zero->sizes() == zero_shape, "zero");
    *zp = zero->data_ptr<int8_t>();
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N, "bias");
    *bp = bias->data_ptr<float>();
  }
}

// f(std::integral_constant<int, M>) for the batch rows M = 1..8 a kernel is compiled for (more
// rows use the 8-row code): the one switch from a run-time row count to a template argument.
template <typename F>
auto for_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

}  // namespace gptforge_wo
