// Batch-1 / small-batch products with weight-only int8, int4 and bf16 layers (gptforge, issue #32):
// y[m, n] = sum_k x[m, k] * (q[n, k] - zero[n, g]) * scale[n, g] + bias[n], fp32 accumulation.
//
// Weights stay in the stored format (transforms/lowbit.py): int8 [N, K] or int4 packed two per
// byte [N, K/2] (column 2j in the low nibble, 2j+1 in the high one, as q + 8), one fp32 scale
// (and int8 zero) per row and group of `group_size` columns. Each group's integers minus its
// zero are exact small integers; the vector paths multiply the stored integers (exact in fp32)
// with x and subtract the offset times the group's sum of x (wo_exact_body.inc), the scalar
// path subtracts it per weight; each group's sum is scaled once. So the result differs from
// F.linear(x, dequant(W)) only by fp32 rounding.
//
// bf16 [N, K] (bits 16) is the same product with no scale, zero or groups: a bf16 value is the
// upper half of the fp32 with the same value, so widening it (16 bits shifted up) is exact and
// the result is x · W.float()ᵀ within fp32 rounding. It reads half of fp32's bytes on any CPU
// (no bf16 arithmetic needed), which is what bounds a batch-1 step.
//
// int4: V bytes widened to 32-bit lanes give V low nibbles (even columns) and, shifted, V high
// ones (odd columns); x is permuted once per call so that within each block of 2V columns of a
// group the even columns come first and the odd ones after (V: the ISA's vector width). On
// AVX-512, groups of a multiple of 32 columns look each nibble's dequantized value up instead
// (lut_block): x times dequantize()'s own values, a row's bits the same in any batch.
//
// ISA paths are compiled under their own target pragmas (never -march: a built library may
// move to another CPU); the caller picks one with `isa` after asking `cpu_isa()`.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_isa.h"
#include "exp_poly.h"
#include "kernels.h"
#include "weight_operands.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace {

using gptforge_wo::cpu_has;
using gptforge_wo::kAvx2;
using gptforge_wo::kAvx512;
using gptforge_wo::kScalar;
constexpr int kMaxRows = 8;  // batch rows one call handles; the caller falls back above
constexpr int64_t kPrefetchBlocks = 2;  // how far ahead the vector paths prefetch, in row blocks

struct Problem {
  const float* x;        // [M, K] (int4 on the vector paths: permuted, see permute_x)
  const float* xsum;     // [M, G]: each group's sum of x (vector paths)
  const uint8_t* w;      // int8 [N, K], packed int4 [N, K/2] or bf16 [N, K], as bytes
  const float* scale;    // [N, G]; null for bf16 (G = 1)
  const int8_t* zero;    // [N, G] or null (symmetric)
  const float* bias;     // [N] or null
  float* y;              // [M, N]
  int64_t M, N, K, G, g;
  int bits;
};

// Integer offset subtracted from a group's stored values: its zero, plus 8 for int4's nibbles.
// The helpers the vector paths call are always inlined: compiled apart they are non-VEX code,
// and calling them per row from AVX code measured 2-3x slower on this AMD EPYC (issue #32).
#define GF_INLINE __attribute__((always_inline)) inline
GF_INLINE int offset(const Problem& p, int64_t n, int64_t gi) {
  return (p.zero ? p.zero[n * p.G + gi] : 0) + (p.bits == 4 ? 8 : 0);
}

// Column k's stored value as a float: an integer (exact) or bf16 widened (exact).
GF_INLINE float stored(const Problem& p, const uint8_t* row, int64_t k) {
  if (p.bits == 16) {
    uint16_t h;
    std::memcpy(&h, row + 2 * k, 2);
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  if (p.bits == 8) return static_cast<int8_t>(row[k]);
  const uint8_t b = row[k >> 1];
  return (k & 1) ? (b >> 4) : (b & 0x0F);
}

GF_INLINE float group_scale(const Problem& p, int64_t n, int64_t gi) {
  return p.scale ? p.scale[n * p.G + gi] : 1.f;  // bf16: none (times 1 is exact)
}

GF_INLINE void finish_row(const Problem& p, int64_t n, const float* acc) {
  const float b = p.bias ? p.bias[n] : 0.f;
  for (int64_t m = 0; m < p.M; ++m) p.y[m * p.N + n] = acc[m] + b;
}

// What the vector paths subtract from their sum over each group's first `gv` columns (x times
// the stored integers): sum over groups of scale * (offset * the group's sum of x - the rest of
// the group's columns, x times stored integer, in column order).
GF_INLINE float scalar_share(const Problem& p, const uint8_t* row, int64_t n, int64_t m, int64_t gv) {
  float c = 0.f;
  for (int64_t gi = 0; gi < p.G; ++gi) {
    float part = 0.f;
    for (int64_t k = gi * p.g + gv; k < (gi + 1) * p.g; ++k) part += p.x[m * p.K + k] * stored(p, row, k);
    const int off = offset(p, n, gi);  // bf16: always 0, and no group sums are computed
    c += group_scale(p, n, gi) * ((off ? static_cast<float>(off) * p.xsum[m * p.G + gi] : 0.f) - part);
  }
  return c;
}

// ------------------------------------------------------------------------------ scalar

void rows_scalar(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t row_bytes = p.K * p.bits / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * row_bytes;
    float acc[kMaxRows] = {0.f};
    for (int64_t gi = 0; gi < p.G; ++gi) {
      const float off = static_cast<float>(offset(p, n, gi));  // integers: the difference stays exact
      const float s = group_scale(p, n, gi);
      for (int64_t m = 0; m < p.M; ++m) {
        const float* xm = p.x + m * p.K;
        float part = 0.f;
        for (int64_t k = gi * p.g; k < (gi + 1) * p.g; ++k) part += xm[k] * (stored(p, row, k) - off);
        acc[m] += part * s;
      }
    }
    finish_row(p, n, acc);
  }
}

// ------------------------------------------------------------------------------ AVX2 + FMA

// Each ISA's vector primitives, then the shared body (wo_exact_body.inc) compiled for that ISA.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "simd_avx2.inc"
inline VF wi8(const uint8_t* w) { return vload(reinterpret_cast<const int8_t*>(w)); }
// 8 bytes = 16 nibbles: the low ones (even columns) and the high ones (odd columns) as floats.
inline void wi4(const uint8_t* w, VF* lo, VF* hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  *lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
// 8 bf16 (16 bytes) widened to fp32: each 16 bits zero-extended, then shifted into the upper half.
inline VF wbf(const uint8_t* w) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
#include "wo_exact_body.inc"
}  // namespace avx2
#pragma GCC pop_options

// ------------------------------------------------------------------------------ AVX-512F

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
#include "simd_avx512.inc"
inline VF wi8(const uint8_t* w) { return vload(reinterpret_cast<const int8_t*>(w)); }
inline void wi4(const uint8_t* w, VF* lo, VF* hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  *lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
inline VF wbf(const uint8_t* w) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
#include "wo_exact_body.inc"

// int4 with groups of whole steps of 32 columns: each group's 16 possible weights, (nibble -
// offset) * scale, fill one vector that `_mm512_permutexvar_ps` looks each lane's low 4 bits up
// in. A step is one byte widening, one shift, two lookups and the FMAs, with no group sums and no
// offsets' share: the products are x times dequantize()'s own values. Two accumulators per row
// (the low and the high nibbles) at every batch size, so a row's bits do not depend on its batch.
// One row's 8 streams (R = 8) read DRAM at 1.4x the rate of 4 on the Zen 5 EPYC (issue #32).
// ZP: the groups have zero points; without, every offset is 8 and a lookup is (iota - 8) times
// the scale, one multiply (the offset's load, convert and subtraction per row and group were a
// third of the instructions of a g64 group).
template <int M, int R, bool ZP>
inline void lut_block(const Problem& p, int64_t n) {
  const int64_t rb = p.K / 2, steps = p.g / 32;
  const char* pf = reinterpret_cast<const char*>(p.w + (n + kPrefetchBlocks * R) * rb);
  const char* pf_end = reinterpret_cast<const char*>(p.w + p.N * rb);
  if (n + (kPrefetchBlocks + 1) * R <= p.N) {  // the scales of the block the weights prefetch for
    const char* sp = reinterpret_cast<const char*>(p.scale + (n + kPrefetchBlocks * R) * p.G);
    for (int64_t j = 0; j < R * p.G * 4; j += 64) _mm_prefetch(sp + j, _MM_HINT_T0);
  }
  const VF iota = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  const VF centered = _mm512_sub_ps(iota, vset1(8.f));  // exact: the same values as iota - offset 8
  // The loops over the accumulators are unrolled (here and after the groups) so that they live in
  // registers only: rolled, GCC kept them in stack arrays zeroed by `rep stos` every block, and
  // the kernel took 1.2x as long (39 vs 32 us a 768x2304 call, one Zen 5 thread).
  VF lo_acc[R][M], hi_acc[R][M];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) lo_acc[r][m] = vzero(), hi_acc[r][m] = vzero();
  const uint8_t* wp = p.w + n * rb;  // row 0's next bytes; row r's are rb further each
  const float* xp = p.x;
  for (int64_t gi = 0; gi < p.G; ++gi) {
    VF lut[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      lut[r] = vmul(ZP ? _mm512_sub_ps(iota, vset1(static_cast<float>(offset(p, n + r, gi)))) : centered,
                    vset1(p.scale[(n + r) * p.G + gi]));
    for (int64_t s = 0; s < steps; ++s, xp += 32, wp += 16, pf += R * 16) {
      for (int j = 0; j < R * 16; j += 64)
        if (pf + j < pf_end) _mm_prefetch(pf + j, _MM_HINT_T0);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + r * rb)));
        const VF lo = _mm512_permutexvar_ps(v, lut[r]);
        const VF hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut[r]);
        for (int m = 0; m < M; ++m) {
          lo_acc[r][m] = vfma(vload(xp + m * p.K), lo, lo_acc[r][m]);
          hi_acc[r][m] = vfma(vload(xp + m * p.K + 16), hi, hi_acc[r][m]);
        }
      }
    }
  }
  float out[R][kMaxRows];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) out[r][m] = vsum(vadd(lo_acc[r][m], hi_acc[r][m]));
  for (int r = 0; r < R; ++r) finish_row(p, n + r, out[r]);
}

template <int M>
void rows_lut(const Problem& p, int64_t n0, int64_t n1) {
  constexpr int R = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1;  // accumulators and lookups fit the 32 registers
  // The blocks prefetch kPrefetchBlocks ahead (weights and scales): ask for the first blocks' weights now.
  const char* first = reinterpret_cast<const char*>(p.w + n0 * (p.K / 2));
  const char* first_end = reinterpret_cast<const char*>(p.w + std::min(n1, n0 + kPrefetchBlocks * R) * (p.K / 2));
  for (; first < first_end; first += 64) _mm_prefetch(first, _MM_HINT_T0);
  int64_t n = n0;
  if (p.zero) {
    for (; n + R <= n1; n += R) lut_block<M, R, true>(p, n);
    for (; n < n1; ++n) lut_block<M, 1, true>(p, n);
  } else {
    for (; n + R <= n1; n += R) lut_block<M, R, false>(p, n);
    for (; n < n1; ++n) lut_block<M, 1, false>(p, n);
  }
}
}  // namespace avx512
#pragma GCC pop_options

// ------------------------------------------------------------------------------ dispatch

using RowsFn = void (*)(const Problem&, int64_t, int64_t);

template <int M>
RowsFn pick_m(int64_t isa, int bits) {
  if (isa == kAvx512) return bits == 4 ? &avx512::rows<M, 4> : bits == 8 ? &avx512::rows<M, 8> : &avx512::rows<M, 16>;
  if (isa == kAvx2) return bits == 4 ? &avx2::rows<M, 4> : bits == 8 ? &avx2::rows<M, 8> : &avx2::rows<M, 16>;
  return &rows_scalar;
}

// AVX-512 int4 takes the lookups where every group is whole steps of 32 columns.
bool lut_path(int64_t isa, int bits, int64_t g) { return isa == kAvx512 && bits == 4 && g % 32 == 0; }

RowsFn pick(int64_t isa, int bits, int64_t M, int64_t g) {
  return gptforge_wo::for_rows(M, [&](auto m) -> RowsFn {
    constexpr int MM = decltype(m)::value;
    return lut_path(isa, bits, g) ? &avx512::rows_lut<MM> : pick_m<MM>(isa, bits);
  });
}

// int4: within each group, every whole block of 2V columns as [even columns, odd columns]
// (they meet the low and the high nibbles of V bytes).
at::Tensor permute_x(const at::Tensor& x, int64_t g, int64_t V) {
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
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

// Each group's sum of x ([M, G]): the offsets' share of the product, once per call.
at::Tensor group_sums(const at::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), g = K / G;
  at::Tensor out = at::empty({M, G}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < G; ++gi) {
      float t = 0.f;
      for (int64_t k = gi * g; k < (gi + 1) * g; ++k) t += src[m * K + k];
      dst[m * G + gi] = t;
    }
  return out;
}

int64_t cpu_isa() { return cpu_has(kAvx512) ? kAvx512 : cpu_has(kAvx2) ? kAvx2 : kScalar; }

}  // namespace

// The entry point (kernels.h: the fused decode step calls it directly).
namespace gptforge_wo {

at::Tensor wo_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                     const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias, int64_t bits,
                     int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8 || bits == 16, "bits: 4, 8 or 16 (bf16)");
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run ISA path ", isa);
  const bool bf16 = bits == 16;
  const bool has_scale = scale.has_value() && scale->defined();
  TORCH_CHECK(has_scale != bf16, bf16 ? "bf16 weights take no scale" : "int8 / int4 weights need their scales");
  TORCH_CHECK(!bf16 || !zero.has_value() || !zero->defined(), "bf16 weights take no zero");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = bf16 ? 1 : scale->size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "batch rows: 1..", kMaxRows);
  TORCH_CHECK(w.is_contiguous() && w.dim() == 2 && w.size(1) == (bits == 4 ? K / 2 : K) &&
                  (bf16 ? w.scalar_type() == at::kBFloat16 : w.element_size() == 1),
              "w: contiguous int8 [N, K], packed int4 [N, K/2] or bf16 [N, K]");
  TORCH_CHECK(bf16 || (scale->is_contiguous() && scale->scalar_type() == at::kFloat && scale->size(0) == N &&
                       K % G == 0),
              "scale shape");
  const int64_t g = K / G;
  TORCH_CHECK(bits != 4 || g % 2 == 0, "int4 groups must have an even number of columns");
  Problem p{};
  const bool lut = lut_path(isa, static_cast<int>(bits), g);
  at::Tensor xs = bf16 || lut ? at::Tensor() : group_sums(x, G);  // bf16, lookups: no offsets to fold out
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor xin = bits == 4 && isa != kScalar ? permute_x(x, g, isa == kAvx512 ? 16 : 8) : x;
  p.x = xin.data_ptr<float>();
  p.xsum = xs.defined() ? xs.data_ptr<float>() : nullptr;
  p.w = static_cast<const uint8_t*>(w.data_ptr());
  p.scale = bf16 ? nullptr : scale->data_ptr<float>();
  gptforge_wo::optional_operands(zero, bias, bf16 ? c10::IntArrayRef() : scale->sizes(), N, &p.zero, &p.bias);
  p.y = y.data_ptr<float>();
  p.M = M, p.N = N, p.K = K, p.G = G, p.g = g, p.bits = static_cast<int>(bits);
  const RowsFn fn = pick(isa, p.bits, M, g);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K));  // ~16K weights per task
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { fn(p, n0, n1); });
  return y;
}

}  // namespace gptforge_wo

// How many of torch's intra-op threads one at::parallel_for over `tasks` items runs on: the check
// that this library was built with torch's threading (without OpenMP the template runs serially).
int64_t threads_used(int64_t tasks) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) { seen |= uint64_t{1} << (at::get_thread_num() % 64); });
  return __builtin_popcountll(seen.load());
}

TORCH_LIBRARY(gptforge_wo, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? scale, Tensor? zero, Tensor? bias, int bits, int isa) -> Tensor",
        &gptforge_wo::wo_linear);
  m.def("cpu_isa() -> int", &cpu_isa);
  m.def("max_rows() -> int", []() -> int64_t { return kMaxRows; });
  m.def("threads_used(int tasks) -> int", &threads_used);
}
