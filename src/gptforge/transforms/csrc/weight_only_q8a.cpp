// Opt-in integer-dot variant of the weight-only products (GPTFORGE_WEIGHT_KERNEL=native-q8a):
// the activations are rounded to int8 per block of 32 columns (step d = max|x| / 127, the
// scheme of llama.cpp's q8 activations), so each block's product with the weights is an exact
// integer sum:
//   y[m, n] = sum_g s[n, g] * sum_{b in g} d[m, b] * (sum_{k in b} xq[m, k] * q[n, k] - zero[n, g] * bsum[m, b])
// with bsum the block's sum of xq (int4 stores q + 8: its offset is zero + 8). Weight groups
// must hold whole blocks of 32 columns. The rounding of x is the approximation (like llama.cpp's
// q8_0 x q4_0 dot products); the integer sums are exact (u8 x s8 pairs stay below 2^15).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_isa.h"
#include "kernels.h"
#include "weight_operands.h"

namespace {

using gptforge_wo::cpu_has;
using gptforge_wo::kAvx2;
using gptforge_wo::kScalar;
constexpr int64_t kBlock = 32;

struct Q8Problem {
  const int8_t* xq;    // [M, K] int8 activations (int4 on AVX2: each block as [even cols, odd cols])
  const float* d;      // [M, K/32] steps
  const float* gcorr;  // [M, G]: sum over the group's blocks of d * bsum
  const uint8_t* w;
  const float* scale;
  const int8_t* zero;
  const float* bias;
  float* y;
  int64_t M, N, K, G, g;
  int bits;
};

#define GF_AVX2 __attribute__((target("avx2,fma")))

// Row m of x rounded block by block as quantize_act's scalar loop does: steps into d, the int8
// values into xq (int4's column order if `permute`), each block's sum into sums. The maximum
// skips NaNs as fmax does (max_ps returns its second operand when the first is NaN) and a NaN
// quotient rounds to 0, as the scalar cast made it.
GF_AVX2 void round_row_avx2(const float* x, int64_t nb, bool permute, int8_t* xq, float* d, int32_t* sums) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                              0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    __m256 a = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) a = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * i)), a);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float step = _mm_cvtss_f32(h) / 127.f;
    d[b] = step;
    __m256i q[4];
    const __m256 vs = _mm256_set1_ps(step);
    for (int i = 0; i < 4; ++i) {
      const __m256 t = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xb + 8 * i), vs),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[i] = step > 0.f ? _mm256_cvtps_epi32(_mm256_and_ps(t, _mm256_cmp_ps(t, t, _CMP_ORD_Q)))
                        : _mm256_setzero_si256();
    }
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    sums[b] = _mm_cvtsi128_si32(s4);
    __m256i v = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    if (permute) v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, evens_odds), _MM_SHUFFLE(3, 1, 2, 0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock), v);
  }
}

// Round each block of 32 to int8 (half to even, as torch.round); `permute`: int4's column order;
// `avx2`: round on the AVX2 path (the same bits). The groups' sums stay in this function: compiled
// without FMA, step * sum is rounded before it is added, on every path.
void quantize_act(const float* x, int64_t M, int64_t K, int64_t G, bool permute, int8_t* xq, float* d,
                  float* gcorr, bool avx2) {
  const int64_t nb = K / kBlock, bpg = nb / G;
  std::vector<int32_t> sums(nb);
  for (int64_t m = 0; m < M; ++m) {
    if (avx2) round_row_avx2(x + m * K, nb, permute, xq + m * K, d + m * nb, sums.data());
    for (int64_t b = 0; b < nb && !avx2; ++b) {
      const float* xb = x + m * K + b * kBlock;
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
      const float step = amax / 127.f;
      int32_t sum = 0;
      int8_t* qb = xq + m * K + b * kBlock;
      for (int64_t j = 0; j < kBlock; ++j) {
        const int8_t q = step > 0.f ? static_cast<int8_t>(std::nearbyint(xb[j] / step)) : 0;
        sum += q;
        qb[permute ? (j % 2) * 16 + j / 2 : j] = q;
      }
      d[m * nb + b] = step;
      sums[b] = sum;
    }
    for (int64_t gi = 0; gi < G; ++gi) {
      float gc = 0.f;
      for (int64_t b = gi * bpg; b < (gi + 1) * bpg; ++b) gc += d[m * nb + b] * static_cast<float>(sums[b]);
      gcorr[m * G + gi] = gc;
    }
  }
}

__attribute__((always_inline)) inline int offset(const Q8Problem& p, int64_t n, int64_t gi) {
  return (p.zero ? p.zero[n * p.G + gi] : 0) + (p.bits == 4 ? 8 : 0);
}

// always inlined: called from the AVX2 rows, a call into non-VEX code costs more than the row
__attribute__((always_inline)) inline void finish(const Q8Problem& p, int64_t n, int64_t m, float dot, float corr) {
  p.y[m * p.N + n] = dot - corr + (p.bias ? p.bias[n] : 0.f);
}

void rows_scalar(const Q8Problem& p, int64_t n0, int64_t n1) {
  const int64_t nb = p.K / kBlock, bpg = nb / p.G, row_bytes = p.bits == 4 ? p.K / 2 : p.K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * row_bytes;
    for (int64_t m = 0; m < p.M; ++m) {
      float dot = 0.f, corr = 0.f;
      for (int64_t gi = 0; gi < p.G; ++gi) {
        const float s = p.scale[n * p.G + gi];
        float part = 0.f;
        for (int64_t b = gi * bpg; b < (gi + 1) * bpg; ++b) {
          int32_t acc = 0;
          for (int64_t j = 0; j < kBlock; ++j) {
            const int64_t k = b * kBlock + j;
            const int q = p.bits == 8 ? static_cast<int8_t>(row[k]) : (k & 1) ? row[k >> 1] >> 4 : row[k >> 1] & 15;
            acc += q * p.xq[m * p.K + k];
          }
          part += p.d[m * nb + b] * static_cast<float>(acc);
        }
        dot += s * part;
        corr += s * static_cast<float>(offset(p, n, gi)) * p.gcorr[m * p.G + gi];
      }
      finish(p, n, m, dot, corr);
    }
  }
}

GF_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 weights of one block as unsigned bytes for maddubs (int8: |q|, its sign moved onto x by
// the caller; int4: the 16 low nibbles, then the 16 high ones).
template <int BITS>
GF_AVX2 inline __m256i block_bytes(const uint8_t* row, int64_t b) {
  if (BITS == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16)));
  return _mm256_and_si256(_mm256_blend_epi32(v, _mm256_srli_epi16(v, 4), 0xF0), _mm256_set1_epi8(0x0F));
}

// Rows [n, n + R): each block of xq (and its step) loaded once for the R rows; the next row
// blocks prefetched (R interleaved streams defeat the hardware prefetcher).
template <int M, int R, int BITS>
GF_AVX2 inline void row_block(const Q8Problem& p, int64_t n) {
  const int64_t nb = p.K / kBlock, bpg = nb / p.G, rb = BITS == 4 ? p.K / 2 : p.K;
  constexpr int64_t bb = BITS == 4 ? 16 : kBlock;  // bytes of one block of one row
  const char* pf = reinterpret_cast<const char*>(p.w + (n + 2 * R) * rb);
  const char* pf_end = reinterpret_cast<const char*>(p.w + p.N * rb);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 tot[R][M];
  float corr[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) tot[r][m] = _mm256_setzero_ps(), corr[r][m] = 0.f;
  const uint8_t* wp = p.w + n * rb;  // row 0's next block; row r's is r * rb further
  const int8_t* xb = p.xq;
  const float* db = p.d;
  const float* sp = p.scale + n * p.G;
  for (int64_t gi = 0; gi < p.G; ++gi) {
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < bpg; ++b, wp += bb, xb += kBlock, ++db) {
      for (int64_t j = 0; j < R * bb; j += 64, pf += 64)
        if (pf < pf_end) _mm_prefetch(pf, _MM_HINT_T0);
      __m256i xv[M];
      __m256 dv[M];
      for (int m = 0; m < M; ++m) {
        xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + m * p.K));
        dv[m] = _mm256_set1_ps(db[m * nb]);
      }
      for (int r = 0; r < R; ++r) {
        const __m256i wu = block_bytes<BITS>(wp + r * rb, 0);
        const __m256i wabs = BITS == 4 ? wu : _mm256_sign_epi8(wu, wu);
        for (int m = 0; m < M; ++m) {
          const __m256i xs = BITS == 4 ? xv[m] : _mm256_sign_epi8(xv[m], wu);
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), ones);
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dv[m], acc[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float s = sp[r * p.G + gi];
      const float so = s * static_cast<float>(offset(p, n + r, gi));
      for (int m = 0; m < M; ++m) {
        tot[r][m] = _mm256_fmadd_ps(acc[r][m], _mm256_set1_ps(s), tot[r][m]);
        corr[r][m] += so * p.gcorr[m * p.G + gi];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) finish(p, n + r, m, hsum(tot[r][m]), corr[r][m]);
}

template <int M, int BITS>
GF_AVX2 void rows_avx2(const Q8Problem& p, int64_t n0, int64_t n1) {
  constexpr int R = M == 1 ? 4 : M <= 3 ? 2 : 1;
  int64_t n = n0;
  for (; n + R <= n1; n += R) row_block<M, R, BITS>(p, n);
  for (; n < n1; ++n) row_block<M, 1, BITS>(p, n);
}

using RowsFn = void (*)(const Q8Problem&, int64_t, int64_t);

template <int M>
RowsFn pick_m(int64_t isa, int bits) {
  if (isa == kScalar) return &rows_scalar;
  return bits == 4 ? &rows_avx2<M, 4> : &rows_avx2<M, 8>;
}

RowsFn pick(int64_t isa, int bits, int64_t M) {
  return gptforge_wo::for_rows(M, [&](auto m) { return pick_m<decltype(m)::value>(isa, bits); });
}

}  // namespace

// The entry point (kernels.h: the fused decode step calls it directly).
namespace gptforge_wo {

// The AVX-512 path of this variant is the AVX2 one (AVX-512 CPUs run it).
at::Tensor wo_linear_q8a(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias, int64_t bits,
                         int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run ISA path ", isa);
  isa = isa > kAvx2 ? kAvx2 : isa;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = scale.size(1);
  TORCH_CHECK(M >= 1 && M <= 8, "batch rows: 1..8");
  TORCH_CHECK(w.is_contiguous() && w.element_size() == 1 && w.size(1) == (bits == 4 ? K / 2 : K), "w shape");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.size(0) == N && K % G == 0,
              "scale shape");
  TORCH_CHECK((K / G) % kBlock == 0, "groups must hold whole blocks of 32 columns");
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / kBlock}, x.options());
  at::Tensor gcorr = at::empty({M, G}, x.options());
  quantize_act(x.data_ptr<float>(), M, K, G, bits == 4 && isa != kScalar, xq.data_ptr<int8_t>(),
               d.data_ptr<float>(), gcorr.data_ptr<float>(), isa != kScalar);
  at::Tensor y = at::empty({M, N}, x.options());
  Q8Problem p{};
  p.xq = xq.data_ptr<int8_t>(), p.d = d.data_ptr<float>(), p.gcorr = gcorr.data_ptr<float>();
  p.w = static_cast<const uint8_t*>(w.data_ptr());
  p.scale = scale.data_ptr<float>();
  gptforge_wo::optional_operands(zero, bias, scale.sizes(), N, &p.zero, &p.bias);
  p.y = y.data_ptr<float>();
  p.M = M, p.N = N, p.K = K, p.G = G, p.g = K / G, p.bits = static_cast<int>(bits);
  const RowsFn fn = pick(isa, p.bits, M);
  const int64_t grain = std::max<int64_t>(1, 16384 / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { fn(p, n0, n1); });
  return y;
}

}  // namespace gptforge_wo

namespace {

// The rounded activations on path `isa` (xq int8 [M, K], d [M, K/32]): in column order, or in
// the order the int4 vector rows read them (`int4_order`: each block as [even cols, odd cols]).
std::tuple<at::Tensor, at::Tensor> quantize_q8a(const at::Tensor& x, int64_t isa, bool int4_order) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % kBlock == 0,
              "x: contiguous fp32 [M, K], K a multiple of 32");
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run ISA path ", isa);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / kBlock}, x.options());
  at::Tensor gcorr = at::empty({M, 1}, x.options());
  quantize_act(x.data_ptr<float>(), M, K, 1, int4_order, xq.data_ptr<int8_t>(), d.data_ptr<float>(),
               gcorr.data_ptr<float>(), isa != kScalar);
  return {xq, d};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gptforge_wo, m) {
  m.def("linear_q8a(Tensor x, Tensor w, Tensor scale, Tensor? zero, Tensor? bias, int bits, int isa) -> Tensor",
        &gptforge_wo::wo_linear_q8a);
  m.def("quantize_q8a(Tensor x, int isa, bool int4_order=False) -> (Tensor, Tensor)", &quantize_q8a);
}
