// The kernels' entry points, callable from C++ as well as through their ops (the fused decode
// step, fused_decode.cpp, calls them directly: one implementation of each, no dispatch per call).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

namespace gptforge_wo {

// gptforge_wo::linear (weight_only_gemv.cpp): x [M, K] fp32 times an int8 / packed int4 weight (with
// its scales) or a bf16 one (scale absent).
at::Tensor wo_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                     const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias, int64_t bits,
                     int64_t isa);

// gptforge_wo::linear_q8a (weight_only_q8a.cpp): the same with x rounded to int8 per 32 columns.
at::Tensor wo_linear_q8a(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias, int64_t bits,
                         int64_t isa);

// gptforge_wo::decode_attention (decode_attention.cpp): one new token per slot.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                            const std::vector<at::Tensor>& k_scales, const std::vector<at::Tensor>& v_scales,
                            c10::IntArrayRef starts, double scale, int64_t isa);

// gptforge_wo::fp32_gemv (fp32_gemv.cpp): one fp32 row in the packed kernel's summation order.
at::Tensor fp32_gemv(const at::Tensor& wb, const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t N,
                     int64_t isa);

// gptforge_wo::int8_rows (int8_rows.cpp): x [M, K] rounded to integers of `step` (±qmax) times packed
// int8 weights, summed exactly, scaled by float(step) * w_scale (+ bias).
at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& w_scale,
                     const c10::optional<at::Tensor>& bias, double step, int64_t N, int64_t qmax, int64_t isa);

// gptforge_wo::gelu_tanh (gelu.cpp): GELU's tanh approximation, the same bits on every path.
at::Tensor gelu_tanh(const at::Tensor& x, int64_t isa);

}  // namespace gptforge_wo
