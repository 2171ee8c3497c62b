// The whole block stack of a one-sequence, one-token decode step in one call (gptforge, issue #32).
//
// At batch 1 a GPT-2 124M decode step spends as much time around its matrix products as in the
// weight-only kernels: ~500 ATen op dispatches from Python and ~60 module calls per token. A
// `DecodePlan` holds, once, every block's layer norms and the operands of its four Linears as
// the decode backend runs them (generate/fused_step.py builds it); `fused_decode` then runs the
// blocks and the final layer norm for one token, calling the very same ATen ops and gptforge
// kernels, on tensors of the same shapes, in the same order as the Python forward
// (model/gpt.py: Block.forward, SelfAttention.forward, RaggedBatch.attend's native path), so the
// result is bit for bit the Python step's: nothing is reordered, fused into another kernel or
// computed at another precision; only the interpreter and the module calls are gone.
//
// A Linear runs as the backend would run it for one fp32 row: the one-row GEMV in the packed
// kernel's order (fp32_gemv.cpp), oneDNN's packed kernel (mkldnn::_linear_pointwise, as
// generate/backend.py calls it), F.linear (at::linear), the weight-only kernels
// (weight_only_gemv.cpp / weight_only_q8a.cpp) after AWQ's input division, or a real INT8 layer
// with a static activation step on gptforge's int8 kernel (int8_rows.cpp) after its clip.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/div.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_isa.h"
#include "kernels.h"

namespace {

// How one Linear runs (generate/fused_step.py names the same kinds).
enum Kind : int64_t { kGemv = 0, kPacked = 1, kPlain = 2, kWeightOnly = 3, kWeightOnlyQ8a = 4, kInt8 = 5 };

struct Linear {
  int64_t kind = kPlain;
  at::Tensor w;  // 64-output blocks (kGemv), oneDNN's packed copy (kPacked), the fp32 weight (kPlain),
                 // the stored int8 / packed int4 / bf16 weight (weight-only kinds), int8 panels (kInt8)
  c10::optional<at::Tensor> scale, zero, bias, act_scale;
  int64_t n = 0, bits = 0, isa = 0;
  double step = 0, clip = 0;  // kInt8: the static activation step and the clip before rounding
};

struct Norm {
  at::Tensor w, b;
  double eps = 1e-5;
};

struct Layer {
  Norm ln1, ln2;
  int64_t heads = 0, head_dim = 0;
  double scale = 1.0;  // the attention's 1/sqrt(head_dim), as Python computed it
};

struct DecodePlan : torch::CustomClassHolder {
  std::vector<Layer> layers;
  std::vector<Linear> linears;  // four per layer, in BLOCK_LINEARS order: qkv, out, fc, proj
  Norm final_norm;
  bool has_final = false;

  void add_layer(at::Tensor w1, at::Tensor b1, double eps1, at::Tensor w2, at::Tensor b2, double eps2,
                 int64_t heads, int64_t head_dim, double scale) {
    layers.push_back(Layer{Norm{w1, b1, eps1}, Norm{w2, b2, eps2}, heads, head_dim, scale});
  }

  void add_linear(int64_t kind, at::Tensor w, c10::optional<at::Tensor> scale, c10::optional<at::Tensor> zero,
                  c10::optional<at::Tensor> bias, c10::optional<at::Tensor> act_scale, int64_t n, int64_t bits,
                  int64_t isa) {
    TORCH_CHECK(kind >= kGemv && kind <= kWeightOnlyQ8a, "unknown Linear kind ", kind);
    TORCH_CHECK(kind < kWeightOnly || scale.has_value() == (bits != 16),
                "a weight-only Linear needs its scales (int8 / int4) or none (bf16)");
    TORCH_CHECK(kind != kWeightOnlyQ8a || bits != 16, "bf16 weights have no q8a variant");
    linears.push_back(Linear{kind, w, scale, zero, bias, act_scale, n, bits, isa});
  }

  // A real INT8 layer (transforms/int8.py, static activations, `native` path): its panels, weight
  // steps and bias, its activation step and clip (min(qmax * step, PACT alpha)).
  void add_int8_linear(at::Tensor panels, at::Tensor w_scale, c10::optional<at::Tensor> bias, int64_t n, double step,
                       double clip, int64_t isa) {
    TORCH_CHECK(step > 0 && clip > 0, "an INT8 Linear needs a positive step and clip");
    Linear l{kInt8, panels, w_scale, c10::nullopt, bias, c10::nullopt, n, 8, isa};
    l.step = step, l.clip = clip;
    linears.push_back(l);
  }

  void set_final_norm(at::Tensor w, at::Tensor b, double eps) {
    final_norm = Norm{w, b, eps};
    has_final = true;
  }
};

// oneDNN's packed Linear exactly as the backend calls it from Python: (x, packed, bias, "none", [], "").
at::Tensor packed_linear(const Linear& l, const at::Tensor& x) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, l.w, l.bias.has_value() ? c10::IValue(*l.bias) : c10::IValue(),
                                 c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<c10::optional<at::Scalar>>()), c10::IValue(std::string())};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One Linear on x [1, 1, K] -> [1, 1, n], as its module's forward computes it.
at::Tensor run_linear(const Linear& l, const at::Tensor& x) {
  switch (l.kind) {
    case kGemv:
      return gptforge_wo::fp32_gemv(l.w, x, l.bias, l.n, l.isa);
    case kPacked:
      return packed_linear(l, x);
    case kPlain:
      return at::linear(x, l.w, l.bias);
    case kInt8: {  // Int8Linear.forward: rows of x, the clip, the exact int8 product (+ bias), the view back
      const at::Tensor xc = at::clamp(x.reshape({-1, x.size(-1)}), -l.clip, l.clip);
      std::vector<int64_t> sizes = x.sizes().vec();
      sizes.back() = l.n;
      return gptforge_wo::int8_rows(xc.contiguous(), l.w, *l.scale, l.bias, l.step, l.n, 127,
                                    std::min<int64_t>(l.isa, gptforge_wo::kAvx2))  // AVX-512: its AVX2 path
          .view(sizes);
    }
    default: {  // WeightOnlyLinear.matmul: rows of x, AWQ's division, the kernel, the view back
      at::Tensor x2 = x.reshape({-1, x.size(-1)});
      if (l.act_scale.has_value()) x2 = at::div(x2, *l.act_scale);
      at::Tensor y = l.kind == kWeightOnlyQ8a
                         ? gptforge_wo::wo_linear_q8a(x2.contiguous(), l.w, *l.scale, l.zero, l.bias, l.bits, l.isa)
                         : gptforge_wo::wo_linear(x2.contiguous(), l.w, l.scale, l.zero, l.bias, l.bits, l.isa);
      std::vector<int64_t> sizes = x.sizes().vec();
      sizes.back() = l.n;
      return y.view(sizes);
    }
  }
}

at::Tensor norm(const Norm& n, const at::Tensor& x) {
  return at::layer_norm(x, {x.size(-1)}, n.w, n.b, n.eps);
}

// A slot's storage for one layer, in decode_attention's list form (one sequence).
struct SlotLists {
  const std::vector<at::Tensor>& keys;
  const std::vector<at::Tensor>& values;
  const std::vector<at::Tensor>& k_scales;  // empty: float32 storage
  const std::vector<at::Tensor>& v_scales;
};

// x + attn(LN1 x) for one token: Block.forward's first half with the native decode attention.
at::Tensor attention_half(const DecodePlan& p, size_t i, const at::Tensor& x, const SlotLists& s, int64_t start,
                          int64_t isa) {
  const Layer& L = p.layers[i];
  const int64_t H = L.heads, D = L.head_dim;
  at::Tensor qkv = run_linear(p.linears[4 * i], norm(L.ln1, x));
  // Each head's [q | k | v] (the per-head interleaved layout) read in place: q, k, v as strided
  // [1, H, D] views, as RaggedBatch.attend passes them.
  const at::Tensor heads = qkv.view({1, H, 3 * D});
  const bool int8 = !s.k_scales.empty();
  at::Tensor y = gptforge_wo::decode_attention(
      heads.narrow(2, 0, D), heads.narrow(2, D, D), heads.narrow(2, 2 * D, D), {s.keys[i]}, {s.values[i]},
      int8 ? std::vector<at::Tensor>{s.k_scales[i]} : std::vector<at::Tensor>{},
      int8 ? std::vector<at::Tensor>{s.v_scales[i]} : std::vector<at::Tensor>{}, {start}, L.scale, isa);
  return at::add(x, run_linear(p.linears[4 * i + 1], y.view({1, 1, H * D})));
}

// x + linear2(gelu(linear1(LN2 x))): Block.forward's second half.
at::Tensor mlp_half(const DecodePlan& p, size_t i, const at::Tensor& x, int64_t isa) {
  at::Tensor f = run_linear(p.linears[4 * i + 2], norm(p.layers[i].ln2, x));
  return at::add(x, run_linear(p.linears[4 * i + 3], gptforge_wo::gelu_tanh(f, isa)));
}

// The final-LayerNorm hidden state [1, 1, hidden] of one token whose embedding is x0 [1, 1, hidden]
// at position `start` of the slot (keys/values per layer; int8 storage with its scales).
at::Tensor fused_decode(const c10::intrusive_ptr<DecodePlan>& plan, const at::Tensor& x0,
                        const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                        const std::vector<at::Tensor>& k_scales, const std::vector<at::Tensor>& v_scales,
                        int64_t start, int64_t isa) {
  const DecodePlan& p = *plan;
  const size_t L = p.layers.size();
  TORCH_CHECK(p.has_final && p.linears.size() == 4 * L, "the plan is incomplete");
  TORCH_CHECK(x0.dim() == 3 && x0.size(0) == 1 && x0.size(1) == 1 && x0.scalar_type() == at::kFloat,
              "x: fp32 [1, 1, hidden]");
  TORCH_CHECK(keys.size() == L && values.size() == L, "one key and one value buffer per layer");
  TORCH_CHECK((k_scales.empty() && v_scales.empty()) || (k_scales.size() == L && v_scales.size() == L),
              "int8 storage: one key and one value scale buffer per layer");
  const SlotLists slot{keys, values, k_scales, v_scales};
  at::Tensor x = x0;
  for (size_t i = 0; i < L; ++i) x = mlp_half(p, i, attention_half(p, i, x, slot, start, isa), isa);
  return norm(p.final_norm, x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptforge_wo, m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("add_linear", &DecodePlan::add_linear)
      .def("add_int8_linear", &DecodePlan::add_int8_linear)
      .def("set_final_norm", &DecodePlan::set_final_norm);
  m.def("fused_decode", &fused_decode);
}
