// The optional operands of a weight-only product, checked once for every kernel that takes them.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace gptforge_wo {

// int8 zeros shaped like `scale` ([N, groups]) and a float bias [N], each null when absent.
inline void optional_operands(const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias,
                              const at::Tensor& scale, int64_t N, const int8_t** zp, const float** bp) {
  *zp = nullptr, *bp = nullptr;
  if (zero.has_value() && zero->defined()) {
    TORCH_CHECK(zero->is_contiguous() && zero->scalar_type() == at::kChar && zero->sizes() == scale.sizes(), "zero");
    *zp = zero->data_ptr<int8_t>();
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N, "bias");
    *bp = bias->data_ptr<float>();
  }
}

}  // namespace gptforge_wo
