// Batch-1 / small-batch products with weight-only int8 and int4 layers (gptforge, issue #32):
// y[m, n] = sum_k x[m, k] * (q[n, k] - zero[n, g]) * scale[n, g] + bias[n], fp32 accumulation.
//
// Weights stay in the stored format (transforms/lowbit.py): int8 [N, K] or int4 packed two per
// byte [N, K/2] (column 2j in the low nibble, 2j+1 in the high one, as q + 8), one fp32 scale
// (and int8 zero) per row and group of `group_size` columns. Each group's integers minus its
// zero are exact small integers, converted to fp32 and multiplied with x; the group's sum is
// scaled once. So the result differs from F.linear(x, dequant(W)) only by fp32 rounding.
//
// int4: rather than interleaving nibbles back into column order, x is permuted once per call
// so that within each block of 2*V columns the even columns come first (they meet the low
// nibbles) and the odd ones after (the high nibbles); V is the ISA's vector width.
//
// ISA paths are separate functions with target attributes (never -march: a built library may
// move to another CPU); the caller picks one with `isa` after asking `cpu_isa()`.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_isa.h"
#include "weight_operands.h"

#include <algorithm>
#include <cstdint>

namespace {

using gptforge_wo::cpu_has;
using gptforge_wo::kAvx2;
using gptforge_wo::kAvx512;
using gptforge_wo::kScalar;
constexpr int kMaxRows = 8;  // batch rows one call handles; the caller falls back above

struct Problem {
  const float* x;        // [M, K] (int4: permuted, see permute_x)
  const uint8_t* w;      // int8 [N, K] or packed int4 [N, K/2], as bytes
  const float* scale;    // [N, G]
  const int8_t* zero;    // [N, G] or null (symmetric)
  const float* bias;     // [N] or null
  float* y;              // [M, N]
  int64_t M, N, K, G, g;
  int bits;
};

// Integer offset subtracted from a group's stored values: its zero, plus 8 for int4's nibbles.
inline int offset(const Problem& p, int64_t n, int64_t gi) {
  return (p.zero ? p.zero[n * p.G + gi] : 0) + (p.bits == 4 ? 8 : 0);
}

inline int stored_int(const Problem& p, const uint8_t* row, int64_t k) {
  if (p.bits == 8) return static_cast<int8_t>(row[k]);
  const uint8_t b = row[k >> 1];
  return (k & 1) ? (b >> 4) : (b & 0x0F);
}

inline void finish_row(const Problem& p, int64_t n, const float* acc) {
  const float b = p.bias ? p.bias[n] : 0.f;
  for (int64_t m = 0; m < p.M; ++m) p.y[m * p.N + n] = acc[m] + b;
}

// ------------------------------------------------------------------------------ scalar

void rows_scalar(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t row_bytes = p.bits == 4 ? p.K / 2 : p.K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * row_bytes;
    float acc[kMaxRows] = {0.f};
    for (int64_t gi = 0; gi < p.G; ++gi) {
      const int off = offset(p, n, gi);
      const float s = p.scale[n * p.G + gi];
      for (int64_t m = 0; m < p.M; ++m) {
        const float* xm = p.x + m * p.K;
        float part = 0.f;
        for (int64_t k = gi * p.g; k < (gi + 1) * p.g; ++k)
          part += xm[k] * static_cast<float>(stored_int(p, row, k) - off);
        acc[m] += part * s;
      }
    }
    finish_row(p, n, acc);
  }
}

// ------------------------------------------------------------------------------ AVX2 + FMA

#define GF_AVX2 __attribute__((target("avx2,fma")))

GF_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc[m] += x[m, k:k+8] * (q - off) for one chunk of 8 int8 weights.
template <int M>
GF_AVX2 inline void chunk8_avx2(const Problem& p, const uint8_t* row, int64_t k, __m256i voff, __m256* acc) {
  const __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)));
  const __m256 wf = _mm256_cvtepi32_ps(_mm256_sub_epi32(qi, voff));
  for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(p.x + m * p.K + k), wf, acc[m]);
}

// The same for 16 int4 weights (8 bytes): even columns into a0, odd ones into a1 (x permuted).
template <int M>
GF_AVX2 inline void chunk16_avx2(const Problem& p, const uint8_t* row, int64_t k, __m128i voff, __m256* a0,
                                 __m256* a1) {
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2));
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, lo4), voff);  // nibble - offset: within int8
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), lo4), voff);
  const __m256 wl = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  const __m256 wh = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  for (int m = 0; m < M; ++m) {
    const float* xk = p.x + m * p.K + k;
    a0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xk), wl, a0[m]);
    a1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 8), wh, a1[m]);
  }
}

// One row's group. A independent accumulators per batch row hide the FMA latency at small M
// (the loops over them have constant bounds: unrolled, the accumulators stay in registers).
template <int M, int BITS>
GF_AVX2 inline void group_avx2(const Problem& p, const uint8_t* row, int64_t k0, int off, float s,
                                __m256* tot, float* tail) {
  constexpr int A = M == 1 ? 4 : M <= 3 ? 2 : 1;
  __m256 acc[A][M];
  for (int a = 0; a < A; ++a)
    for (int m = 0; m < M; ++m) acc[a][m] = _mm256_setzero_ps();
  int64_t k = k0;
  const int64_t end = k0 + p.g;
  if (BITS == 8) {
    const __m256i voff = _mm256_set1_epi32(off);
    for (; k + 8 * A <= end; k += 8 * A)
      for (int a = 0; a < A; ++a) chunk8_avx2<M>(p, row, k + 8 * a, voff, acc[a]);
    for (; k + 8 <= end; k += 8) chunk8_avx2<M>(p, row, k, voff, acc[0]);
  } else {
    constexpr int U = A > 1 ? A / 2 : 1;  // chunks of 16 per step, two accumulators each
    const __m128i voff = _mm_set1_epi8(static_cast<char>(off));
    for (; k + 16 * U <= end; k += 16 * U)
      for (int u = 0; u < U; ++u) chunk16_avx2<M>(p, row, k + 16 * u, voff, acc[(2 * u) % A], acc[(2 * u + 1) % A]);
    for (; k + 16 <= end; k += 16) chunk16_avx2<M>(p, row, k, voff, acc[0], acc[A - 1]);
  }
  const __m256 vs = _mm256_set1_ps(s);
  for (int m = 0; m < M; ++m) {
    __m256 a = acc[0][m];
    for (int aa = 1; aa < A; ++aa) a = _mm256_add_ps(a, acc[aa][m]);
    tot[m] = _mm256_fmadd_ps(a, vs, tot[m]);
    float part = 0.f;  // columns past the last whole chunk: x in column order there
    for (int64_t kk = k; kk < end; ++kk)
      part += p.x[m * p.K + kk] * static_cast<float>(stored_int(p, row, kk) - off);
    tail[m] += part * s;
  }
}

template <int M, int BITS>
GF_AVX2 void rows_avx2(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t row_bytes = BITS == 4 ? p.K / 2 : p.K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * row_bytes;
    __m256 tot[M];
    float tail[M], acc[kMaxRows];
    for (int m = 0; m < M; ++m) tot[m] = _mm256_setzero_ps(), tail[m] = 0.f;
    for (int64_t gi = 0; gi < p.G; ++gi)
      group_avx2<M, BITS>(p, row, gi * p.g, offset(p, n, gi), p.scale[n * p.G + gi], tot, tail);
    for (int m = 0; m < M; ++m) acc[m] = hsum256(tot[m]) + tail[m];
    finish_row(p, n, acc);
  }
}

// ------------------------------------------------------------------------------ AVX-512F

#define GF_AVX512 __attribute__((target("avx512f,avx2,fma")))

template <int M>
GF_AVX512 inline void chunk16_int8_avx512(const Problem& p, const uint8_t* row, int64_t k, __m512i voff,
                                          __m512* acc) {
  const __m512i qi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
  const __m512 wf = _mm512_cvtepi32_ps(_mm512_sub_epi32(qi, voff));
  for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(p.x + m * p.K + k), wf, acc[m]);
}

template <int M>
GF_AVX512 inline void chunk32_int4_avx512(const Problem& p, const uint8_t* row, int64_t k, __m128i voff,
                                          __m512* a0, __m512* a1) {
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, lo4), voff);
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), lo4), voff);
  const __m512 wl = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
  const __m512 wh = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
  for (int m = 0; m < M; ++m) {
    const float* xk = p.x + m * p.K + k;
    a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xk), wl, a0[m]);
    a1[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xk + 16), wh, a1[m]);
  }
}

// As group_avx2, twice as wide (int8 chunks of 16 columns, int4 chunks of 32).
template <int M, int BITS>
GF_AVX512 inline void group_avx512(const Problem& p, const uint8_t* row, int64_t k0, int off, float s,
                                   __m512* tot, float* tail) {
  constexpr int A = M == 1 ? 4 : M <= 3 ? 2 : 1;
  __m512 acc[A][M];
  for (int a = 0; a < A; ++a)
    for (int m = 0; m < M; ++m) acc[a][m] = _mm512_setzero_ps();
  int64_t k = k0;
  const int64_t end = k0 + p.g;
  if (BITS == 8) {
    const __m512i voff = _mm512_set1_epi32(off);
    for (; k + 16 * A <= end; k += 16 * A)
      for (int a = 0; a < A; ++a) chunk16_int8_avx512<M>(p, row, k + 16 * a, voff, acc[a]);
    for (; k + 16 <= end; k += 16) chunk16_int8_avx512<M>(p, row, k, voff, acc[0]);
  } else {
    constexpr int U = A > 1 ? A / 2 : 1;
    const __m128i voff = _mm_set1_epi8(static_cast<char>(off));
    for (; k + 32 * U <= end; k += 32 * U)
      for (int u = 0; u < U; ++u)
        chunk32_int4_avx512<M>(p, row, k + 32 * u, voff, acc[(2 * u) % A], acc[(2 * u + 1) % A]);
    for (; k + 32 <= end; k += 32) chunk32_int4_avx512<M>(p, row, k, voff, acc[0], acc[A - 1]);
  }
  const __m512 vs = _mm512_set1_ps(s);
  for (int m = 0; m < M; ++m) {
    __m512 a = acc[0][m];
    for (int aa = 1; aa < A; ++aa) a = _mm512_add_ps(a, acc[aa][m]);
    tot[m] = _mm512_fmadd_ps(a, vs, tot[m]);
    float part = 0.f;
    for (int64_t kk = k; kk < end; ++kk)
      part += p.x[m * p.K + kk] * static_cast<float>(stored_int(p, row, kk) - off);
    tail[m] += part * s;
  }
}

template <int M, int BITS>
GF_AVX512 void rows_avx512(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t row_bytes = BITS == 4 ? p.K / 2 : p.K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * row_bytes;
    __m512 tot[M];
    float tail[M], acc[kMaxRows];
    for (int m = 0; m < M; ++m) tot[m] = _mm512_setzero_ps(), tail[m] = 0.f;
    for (int64_t gi = 0; gi < p.G; ++gi)
      group_avx512<M, BITS>(p, row, gi * p.g, offset(p, n, gi), p.scale[n * p.G + gi], tot, tail);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_reduce_add_ps(tot[m]) + tail[m];
    finish_row(p, n, acc);
  }
}

// ------------------------------------------------------------------------------ dispatch

using RowsFn = void (*)(const Problem&, int64_t, int64_t);

template <int M>
RowsFn pick_m(int64_t isa, int bits) {
  if (isa == kAvx512) return bits == 4 ? &rows_avx512<M, 4> : &rows_avx512<M, 8>;
  if (isa == kAvx2) return bits == 4 ? &rows_avx2<M, 4> : &rows_avx2<M, 8>;
  return &rows_scalar;
}

RowsFn pick(int64_t isa, int bits, int64_t M) {
  switch (M) {
    case 1: return pick_m<1>(isa, bits);
    case 2: return pick_m<2>(isa, bits);
    case 3: return pick_m<3>(isa, bits);
    case 4: return pick_m<4>(isa, bits);
    case 5: return pick_m<5>(isa, bits);
    case 6: return pick_m<6>(isa, bits);
    case 7: return pick_m<7>(isa, bits);
    default: return pick_m<8>(isa, bits);
  }
}

// int4: within each group, every whole block of 2V columns as [even columns, odd columns].
at::Tensor permute_x(const at::Tensor& x, int64_t g, int64_t V) {
  at::Tensor out = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t M = x.size(0), K = x.size(1), B = 2 * V;
  for (int64_t m = 0; m < M; ++m) {
    const float* s = src + m * K;
    float* d = dst + m * K;
    for (int64_t k0 = 0; k0 < K; k0 += g) {
      int64_t k = k0;
      for (; k + B <= k0 + g; k += B)
        for (int64_t j = 0; j < V; ++j) d[k + j] = s[k + 2 * j], d[k + V + j] = s[k + 2 * j + 1];
      for (; k < k0 + g; ++k) d[k] = s[k];
    }
  }
  return out;
}

int64_t cpu_isa() { return cpu_has(kAvx512) ? kAvx512 : cpu_has(kAvx2) ? kAvx2 : kScalar; }

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                  const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias, int64_t bits,
                  int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run ISA path ", isa);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = scale.size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "batch rows: 1..", kMaxRows);
  TORCH_CHECK(w.is_contiguous() && w.element_size() == 1 && w.size(1) == (bits == 4 ? K / 2 : K), "w shape");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.size(0) == N && K % G == 0,
              "scale shape");
  const int64_t g = K / G;
  TORCH_CHECK(bits == 8 || g % 2 == 0, "int4 groups must have an even number of columns");
  Problem p{};
  at::Tensor xin = bits == 4 && isa != kScalar ? permute_x(x, g, isa == kAvx512 ? 16 : 8) : x;
  at::Tensor y = at::empty({M, N}, x.options());
  p.x = xin.data_ptr<float>();
  p.w = static_cast<const uint8_t*>(w.data_ptr());
  p.scale = scale.data_ptr<float>();
  gptforge_wo::optional_operands(zero, bias, scale, N, &p.zero, &p.bias);
  p.y = y.data_ptr<float>();
  p.M = M, p.N = N, p.K = K, p.G = G, p.g = g, p.bits = static_cast<int>(bits);
  const RowsFn fn = pick(isa, p.bits, M);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K));  // ~16K weights per task
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { fn(p, n0, n1); });
  return y;
}

}  // namespace

TORCH_LIBRARY(gptforge_wo, m) {
  m.def("linear(Tensor x, Tensor w, Tensor scale, Tensor? zero, Tensor? bias, int bits, int isa) -> Tensor",
        &linear);
  m.def("cpu_isa() -> int", &cpu_isa);
  m.def("max_rows() -> int", []() -> int64_t { return kMaxRows; });
}
