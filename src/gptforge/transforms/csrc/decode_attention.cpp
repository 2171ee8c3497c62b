// Decode attention for continuous batching (gptforge, issue #30): every sequence of a ragged
// step that adds one token stores its new key/value in its own slot and attends over its own
// positions 0..start, all sequences and heads in one call instead of one SDPA call (plus a
// write and a read) per sequence and layer, whose fixed costs dominate a decode step's
// attention on a CPU.
//
// Each (sequence, head) is computed by one task in a fixed order over positions and head_dim,
// so a sequence's output never depends on what else is in the step or on the thread count
// (the engine's batch invariance). Slots are [1, heads, capacity, head_dim] in float32, or in
// int8 with one float32 scale per (head, position) (model/kv_cache.py). The int8 write
// quantizes exactly as `kv_cache.quantize_int8` does (max|x| / 127, x / scale rounded half to
// even, clamped), so a position stores the same bytes whichever path wrote it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_isa.h"
#include "exp_poly.h"
#include "kernels.h"

namespace {

struct Slot {
  float* k = nullptr;   // float32 storage, or null
  float* v = nullptr;
  int8_t* kq = nullptr;  // int8 storage, or null
  int8_t* vq = nullptr;
  float* ks = nullptr;   // int8 scales [heads, capacity]
  float* vs = nullptr;
  int64_t start = 0, cap = 0;
};

void quantize_row(const float* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float s = amax / 127.f;
  const float safe = s > 0.f ? s : 1.f;
  for (int64_t d = 0; d < D; ++d) {
    const float r = std::nearbyint(x[d] / safe);  // default rounding: half to even, as torch.round
    q[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  *scale = s;
}

// ---------------------------------------------------------------- scalar (any D)

float dot_scalar(const float* a, const float* b, int64_t D) {
  float acc[8] = {0.f};
  for (int64_t d = 0; d < D; ++d) acc[d & 7] += a[d] * b[d];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

float dot_scalar_i8(const float* a, const int8_t* b, int64_t D) {
  float acc[8] = {0.f};
  for (int64_t d = 0; d < D; ++d) acc[d & 7] += a[d] * static_cast<float>(b[d]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

void axpy_scalar(float p, const float* x, float* y, int64_t D) {
  for (int64_t d = 0; d < D; ++d) y[d] += p * x[d];
}

void axpy_scalar_i8(float p, const int8_t* x, float* y, int64_t D) {
  for (int64_t d = 0; d < D; ++d) y[d] += p * static_cast<float>(x[d]);
}

// How far ahead of the dot products the keys are prefetched, in bytes. A task reads its head's
// positions once, from DRAM in a serving step (64 sequences' caches are far larger than L3), and a
// head's 150 int8 positions are too short a stream for the hardware prefetcher to get ahead of:
// without this the int8 cache's attention ran at ~11 GB/s, compute-bound speed only when in L3.
// The values are prefetched beside the keys, for the weighted sum after the softmax.
constexpr int64_t kAhead = 4096;

float scale_max_scalar(float* s, const float* ks, float scale, int64_t T) {
  float m = -INFINITY;
  for (int64_t t = 0; t < T; ++t) m = std::max(m, s[t] = ks ? s[t] * ks[t] * scale : s[t] * scale);
  return m;
}

float exp_sum_scalar(float* s, float m, int64_t T) {
  float sum = 0.f;
  for (int64_t t = 0; t < T; ++t) sum += (s[t] = gptforge_wo::exp_poly(s[t] - m));
  return sum;
}

void normalize_scalar(float* s, const float* vs, float inv, int64_t T) {
  for (int64_t t = 0; t < T; ++t) s[t] = vs ? s[t] * inv * vs[t] : s[t] * inv;
}

using WeightedSum = void (*)(const float*, const void*, int64_t, float*);

struct Ops {
  float (*dot)(const float*, const float*, int64_t);
  float (*dot_i8)(const float*, const int8_t*, int64_t);
  void (*axpy)(float, const float*, float*, int64_t);
  void (*axpy_i8)(float, const int8_t*, float*, int64_t);
  float (*scale_max)(float*, const float*, float, int64_t);  // the softmax's passes (attention_body.inc)
  float (*exp_sum)(float*, float, int64_t);
  void (*normalize)(float*, const float*, float, int64_t);
  void (*dot4)(const float*, const float*, int64_t, float*) = nullptr;  // null: one position at a time
  void (*dot4_i8)(const float*, const int8_t*, int64_t, float*) = nullptr;
  WeightedSum wsum = nullptr;  // for this D (null: axpy per position)
  WeightedSum wsum_i8 = nullptr;
  void (*quantize)(const float*, int64_t, int8_t*, float*) = quantize_row;  // the int8 write
};

// ---------------------------------------------------------------- AVX2 + FMA (D % 8 == 0)
// Each ISA's vector primitives, then the shared loops (attention_body.inc) compiled for it.

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "simd_avx2.inc"
#include "attention_body.inc"
}  // namespace avx2
#pragma GCC pop_options

// ---------------------------------------------------------------- AVX-512F (D % 16 == 0)
// The same loops on 16 lanes: an int8 key or value's conversion, the step that bounds the int8
// cache's attention, is one widening and one convert per 16 values instead of per 8.

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
#include "simd_avx512.inc"
#include "attention_body.inc"

// quantize_row's bytes and scale on 16 lanes (max is exact in any order; the division and the
// rounding, half to even, are IEEE's on both). The operands of max keep std::max's NaN rule (a NaN
// value is skipped by the max and stored as -127), so non-finite rows store the same bytes too.
void quantize_row(const float* x, int64_t D, int8_t* q, float* scale) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + d)), m);
  const float amax = _mm512_reduce_max_ps(m);
  const float s = amax / 127.f;
  const __m512 safe = _mm512_set1_ps(s > 0.f ? s : 1.f), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + d), safe),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + d),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(r, lo)))));
  }
  *scale = s;
}
}  // namespace avx512
#pragma GCC pop_options

// One (sequence, head): write the new key/value at `start`, then softmax(q.k / sqrt(d)).v over
// positions 0..start. `scores` is the task's scratch buffer.
void one_head(const Ops& ops, const Slot& s, int64_t h, int64_t D, const float* q, const float* kn,
              const float* vn, float scale, float* out, std::vector<float>& scores) {
  const int64_t T = s.start + 1, base = h * s.cap;
  if (s.k) {
    std::copy(kn, kn + D, s.k + (base + s.start) * D);
    std::copy(vn, vn + D, s.v + (base + s.start) * D);
  } else {
    ops.quantize(kn, D, s.kq + (base + s.start) * D, s.ks + base + s.start);
    ops.quantize(vn, D, s.vq + (base + s.start) * D, s.vs + base + s.start);
  }
  scores.resize(T);
  float* sc = scores.data();
  int64_t t = 0;
  const int64_t row = D * (s.k ? 4 : 1);  // bytes per position
  const char* kb = s.k ? reinterpret_cast<const char*>(s.k + base * D) : reinterpret_cast<const char*>(s.kq + base * D);
  const char* vb = s.v ? reinterpret_cast<const char*>(s.v + base * D) : reinterpret_cast<const char*>(s.vq + base * D);
  const int64_t kend = T * row;
  for (int64_t b = 0; b < std::min(kend, kAhead); b += 64) _mm_prefetch(kb + b, _MM_HINT_T0);
  if (ops.dot4) {  // the same dot products, four at a time (attention_body.inc)
    for (; t + 4 <= T; t += 4) {
      for (int64_t b = t * row; b < (t + 4) * row; b += 64) {
        if (b + kAhead < kend) _mm_prefetch(kb + b + kAhead, _MM_HINT_T0);
        _mm_prefetch(vb + b, _MM_HINT_T0);
      }
      if (s.k) ops.dot4(q, s.k + (base + t) * D, D, sc + t);
      else ops.dot4_i8(q, s.kq + (base + t) * D, D, sc + t);
    }
  }
  for (; t < T; ++t) sc[t] = s.k ? ops.dot(q, s.k + (base + t) * D, D) : ops.dot_i8(q, s.kq + (base + t) * D, D);
  const float m = ops.scale_max(sc, s.k ? nullptr : s.ks + base, scale, T);
  ops.normalize(sc, s.v ? nullptr : s.vs + base, 1.f / ops.exp_sum(sc, m, T), T);  // weights (int8: times value scales)
  if (s.v ? ops.wsum != nullptr : ops.wsum_i8 != nullptr) {  // outputs in registers (attention_body.inc)
    if (s.v) ops.wsum(sc, s.v + base * D, T, out);
    else ops.wsum_i8(sc, s.vq + base * D, T, out);
    return;
  }
  std::fill(out, out + D, 0.f);
  for (t = 0; t < T; ++t) {
    if (s.v) ops.axpy(sc[t], s.v + (base + t) * D, out, D);
    else ops.axpy_i8(sc[t], s.vq + (base + t) * D, out, D);
  }
}

Slot slot_of(const at::Tensor& k, const at::Tensor& v, const std::vector<at::Tensor>& ks,
             const std::vector<at::Tensor>& vs, size_t r, int64_t H, int64_t D, int64_t start) {
  TORCH_CHECK(k.dim() == 4 && k.size(0) == 1 && k.size(1) == H && k.size(3) == D && k.is_contiguous() &&
                  v.sizes() == k.sizes() && v.is_contiguous() && v.scalar_type() == k.scalar_type(),
              "slot ", r, ": keys/values must be contiguous [1, heads, capacity, head_dim]");
  Slot s;
  s.cap = k.size(2), s.start = start;
  TORCH_CHECK(start >= 0 && start < s.cap, "slot ", r, ": position ", start, " outside its capacity ", s.cap);
  if (k.scalar_type() == at::kFloat) {
    s.k = k.data_ptr<float>(), s.v = v.data_ptr<float>();
  } else {
    TORCH_CHECK(k.scalar_type() == at::kChar && ks.size() > r && vs.size() > r, "slot ", r,
                ": float32 or int8 (with scales) storage");
    for (const at::Tensor* t : {&ks[r], &vs[r]})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == H * s.cap,
                  "slot ", r, ": int8 scales must be contiguous float32 [1, heads, capacity, 1]");
    s.kq = k.data_ptr<int8_t>(), s.vq = v.data_ptr<int8_t>();
    s.ks = ks[r].data_ptr<float>(), s.vs = vs[r].data_ptr<float>();
  }
  return s;
}

}  // namespace

// The entry point (kernels.h: the fused decode step calls it directly).
namespace gptforge_wo {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                            const std::vector<at::Tensor>& k_scales, const std::vector<at::Tensor>& v_scales,
                            c10::IntArrayRef starts, double scale, int64_t isa) {
  // q, k, v may be strided views (the step's qkv projection split per head, in place): only each
  // head's head_dim values must be adjacent.
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->sizes() == q.sizes() &&
                    (t->size(2) <= 1 || t->stride(2) == 1),
                "q, k, v: float32 [rows, heads, head_dim] with head_dim contiguous");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == R && static_cast<int64_t>(values.size()) == R &&
                  static_cast<int64_t>(starts.size()) == R, "one slot and start per row");
  std::vector<Slot> slots;
  slots.reserve(R);
  for (int64_t r = 0; r < R; ++r) slots.push_back(slot_of(keys[r], values[r], k_scales, v_scales, r, H, D, starts[r]));
  const bool vec = isa > 0 && D % 8 == 0, wide = isa >= gptforge_wo::kAvx512 && D % 16 == 0;
  TORCH_CHECK(!vec || gptforge_wo::cpu_has(wide ? gptforge_wo::kAvx512 : gptforge_wo::kAvx2),
              "this CPU cannot run the ", wide ? "AVX-512" : "AVX2", " path");
  Ops ops = wide ? avx512::ops(D) : vec ? avx2::ops(D) : Ops{dot_scalar, dot_scalar_i8, axpy_scalar, axpy_scalar_i8, scale_max_scalar, exp_sum_scalar,
                                                      normalize_scalar};
  if (wide) ops.quantize = avx512::quantize_row;
  at::Tensor out = at::empty({R, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs[2] = {q.stride(0), q.stride(1)}, ks[2] = {k.stride(0), k.stride(1)},
                vs[2] = {v.stride(0), v.stride(1)};
  int64_t positions = 0;
  for (const Slot& s : slots) positions += s.start + 1;
  // ~32K multiply-adds per task: a batch-1 step stays on one thread.
  const int64_t grain = std::max<int64_t>(1, (32768 * R) / std::max<int64_t>(1, 2 * positions * D));
  at::parallel_for(0, R * H, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / H, h = i % H;
      one_head(ops, slots[r], h, D, qp + r * qs[0] + h * qs[1], kp + r * ks[0] + h * ks[1], vp + r * vs[0] + h * vs[1],
               static_cast<float>(scale), op + i * D, scores);
    }
  });
  return out;
}

}  // namespace gptforge_wo

TORCH_LIBRARY_FRAGMENT(gptforge_wo, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor[] keys, Tensor[] values, Tensor[] k_scales, "
        "Tensor[] v_scales, int[] starts, float scale, int isa) -> Tensor",
        &gptforge_wo::decode_attention);
}
