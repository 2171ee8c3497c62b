// Exact int8 x int8 products for the real INT8 model (transforms/int8.py) on CPUs without VNNI.
//
// fbgemm multiplies unsigned activation bytes by signed weight bytes with `vpmaddubsw`, whose
// int16 pair sums saturate unless each byte is <= 127; without VNNI gptforge therefore runs every
// activation row through it twice (its positive and negative parts: the `split` path). Here each
// activation q in ±127 and each weight in ±127 are widened to int16 and multiplied with `vpmaddwd`:
// two exact products summed into an int32 lane (2 x 127 x 127 fits easily), so every row goes
// through once and the int32 sums are exact for any K below 2^31 / 127^2 (133 million).
//
// y[m, n] = float(sum_k q[m, k] * w[n, k]) * (float(step) * w_scale[n]) (+ bias[n]), where
// q = nearbyint(x * (1 / float(step))) clamped to ±qmax. With qmax 127 (the INT8 layers) that is
// the quantization and the output scaling fbgemm's own call uses, so where fbgemm's one-call
// `plain` path is exact (VNNI) both give the same bits. The LM head's input, which is not
// quantized in the model, goes through with qmax 32767 (16-bit activations, one pass); there an
// int32 lane could overflow past 258 input pairs, so the sums of each chunk of pairs are added
// as floats, in order. Either way a row's result never depends on the other rows.
//
// Weights are packed once per layer (int8.py) as [ceil(N/8), K2/2, 8, 2]: for each panel of 8
// outputs and each pair of inputs, the 8 outputs' two weights (K2: K rounded up to even, padded
// outputs and inputs zero). One 16-byte load widened by `vpmovsxbw` is a panel's pair of inputs
// for 8 outputs; the activation pair is one broadcast int32. A register tile is 3 rows x 3 panels
// (9 accumulators + 3 weights + broadcast + product in the 16 AVX2 registers), and one task's
// panels (3 x 8 outputs x K bytes: 18 KB at K = 768) stay in L1 while every row tile passes.
// AVX-512 CPUs take the AVX2 path (those with VNNI get fbgemm's `plain` path instead).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "kernels.h"

namespace {

using gptforge_wo::cpu_has;
using gptforge_wo::kScalar;

constexpr int64_t kPanel = 8;  // outputs per weight panel
constexpr int kTilePanels = 3;
constexpr int kTileRows = 3;

struct Operands {
  const int8_t* w;    // packed [NB, P, 8, 2], P = K2 / 2 input pairs
  const int16_t* q;   // [M, K2] activations, zero-padded
  const float* c;     // [NB * 8] float(step) * w_scale, zero-padded
  const float* bias;  // [NB * 8] zero-padded, or null
  float* y;           // [M, N]
  int64_t M, N, P, NB;
  int64_t chunk;      // input pairs summed in int32 before a float total takes over (no overflow)
};

// Writes one 8-output panel of row m: lanes beyond N dropped.
inline void store_panel(const Operands& o, int64_t m, int64_t nb, const float* vals) {
  const int64_t n0 = nb * kPanel, n = std::min<int64_t>(kPanel, o.N - n0);
  std::copy(vals, vals + n, o.y + m * o.N + n0);
}

// The panel's 8 outputs of row m from its float sums: sums * c (+ bias), stored.
inline void finish_panel(const Operands& o, int64_t m, int64_t nb, const float* sums) {
  float vals[kPanel];
  for (int64_t j = 0; j < kPanel; ++j) {
    const int64_t n = nb * kPanel + j;
    vals[j] = sums[j] * o.c[n];
    if (o.bias) vals[j] += o.bias[n];
  }
  store_panel(o, m, nb, vals);
}

void panels_scalar(const Operands& o, int64_t nb0, int64_t nb1) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const int8_t* wp = o.w + nb * o.P * 2 * kPanel;
    for (int64_t m = 0; m < o.M; ++m) {
      const int16_t* q = o.q + m * o.P * 2;
      float tot[kPanel];
      for (int64_t p0 = 0; p0 < o.P; p0 += o.chunk) {
        int32_t acc[kPanel] = {0};
        for (int64_t p = p0; p < std::min(o.P, p0 + o.chunk); ++p)
          for (int64_t j = 0; j < kPanel; ++j)
            acc[j] += int32_t{wp[p * 16 + j * 2]} * q[2 * p] + int32_t{wp[p * 16 + j * 2 + 1]} * q[2 * p + 1];
        for (int64_t j = 0; j < kPanel; ++j) tot[j] = p0 == 0 ? static_cast<float>(acc[j]) : tot[j] + acc[j];
      }
      finish_panel(o, m, nb, tot);
    }
  }
}

// int32 sums over input pairs [p0, p1) of rows m0..m0+MR and panels nb..nb+NV into `sums` [MR][NV * 8].
// The loops have constant bounds and are unrolled whole, so the accumulators live in registers
// (9 + 3 weights + broadcast + product of the 16 at 3 x 3); the sums leave them in one go at the end.
template <int MR, int NV>
__attribute__((target("avx2,fma"))) void tile_sums_avx2(const Operands& o, int64_t m0, int64_t nb, int64_t p0,
                                                        int64_t p1, int32_t* sums) {
  const int8_t* wp = o.w + nb * o.P * 2 * kPanel;
  const int64_t stride = o.P * 2 * kPanel, ldq = o.P * 2;
  const int16_t* q = o.q + m0 * ldq;
  __m256i a[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) a[m][v] = _mm256_setzero_si256();
  for (int64_t p = p0; p < p1; ++p) {
    __m256i w[NV];
    for (int v = 0; v < NV; ++v)
      w[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + v * stride + p * 16)));
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, q + m * ldq + 2 * p, sizeof pair);
      const __m256i xb = _mm256_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) a[m][v] = _mm256_add_epi32(a[m][v], _mm256_madd_epi16(w[v], xb));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + (m * NV + v) * kPanel), a[m][v]);
}

// Rows m0..m0+MR of panels nb..nb+NV: the int32 sums of each chunk of input pairs added as floats
// (in order; one chunk, i.e. exact int32 sums, whenever |q| <= 127), scaled, stored.
template <int MR, int NV>
__attribute__((target("avx2,fma"))) void tile_avx2(const Operands& o, int64_t m0, int64_t nb) {
  alignas(32) int32_t sums[MR * NV * kPanel];
  alignas(32) float tot[MR * NV * kPanel];
  for (int64_t p0 = 0; p0 < o.P; p0 += o.chunk) {
    tile_sums_avx2<MR, NV>(o, m0, nb, p0, std::min(o.P, p0 + o.chunk), sums);
    for (int i = 0; i < MR * NV * kPanel; i += kPanel) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sums + i)));
      _mm256_store_ps(tot + i, p0 == 0 ? f : _mm256_add_ps(_mm256_load_ps(tot + i), f));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      const int64_t n0 = (nb + v) * kPanel;
      __m256 r = _mm256_mul_ps(_mm256_load_ps(tot + (m * NV + v) * kPanel), _mm256_loadu_ps(o.c + n0));
      if (o.bias) r = _mm256_add_ps(r, _mm256_loadu_ps(o.bias + n0));
      if (n0 + kPanel <= o.N) {
        _mm256_storeu_ps(o.y + (m0 + m) * o.N + n0, r);
      } else {
        alignas(32) float vals[kPanel];
        _mm256_store_ps(vals, r);
        store_panel(o, m0 + m, nb + v, vals);
      }
    }
}

template <int NV>
__attribute__((target("avx2,fma"))) void panel_rows_avx2(const Operands& o, int64_t nb) {
  int64_t m = 0;
  for (; m + kTileRows <= o.M; m += kTileRows) tile_avx2<kTileRows, NV>(o, m, nb);
  if (o.M - m == 2) tile_avx2<2, NV>(o, m, nb);
  if (o.M - m == 1) tile_avx2<1, NV>(o, m, nb);
}

// Panel groups g0..g1 (kTilePanels panels each, the last one possibly fewer).
void groups_avx2(const Operands& o, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t nb = g * kTilePanels, nv = std::min<int64_t>(kTilePanels, o.NB - nb);
    if (nv == 3) panel_rows_avx2<3>(o, nb);
    else if (nv == 2) panel_rows_avx2<2>(o, nb);
    else panel_rows_avx2<1>(o, nb);
  }
}

// One row: q = nearbyint(x * inv) clamped to ±qmax (the rounding mode's even ties, as fbgemm).
void quantize_row_scalar(const float* x, int64_t K, float inv, float qmax, int16_t* q) {
  for (int64_t k = 0; k < K; ++k)
    q[k] = static_cast<int16_t>(std::min(qmax, std::max(-qmax, std::nearbyint(x[k] * inv))));
}

__attribute__((target("avx2,fma"))) void quantize_row_avx2(const float* x, int64_t K, float inv, float qmax,
                                                           int16_t* q) {
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-qmax), hi = _mm256_set1_ps(qmax);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k),
                     _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
  }
  quantize_row_scalar(x + k, K - k, inv, qmax, q + k);
}

// q [M, K2] int16 (odd K: the last column zero).
at::Tensor quantize_rows(const at::Tensor& x, int64_t K2, float inv, float qmax, int64_t isa) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K2}, x.options().dtype(at::kShort));
  const float* xp = x.data_ptr<float>();
  int16_t* qp = q.data_ptr<int16_t>();
  auto row = isa == kScalar ? quantize_row_scalar : quantize_row_avx2;
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      row(xp + m * K, K, inv, qmax, qp + m * K2);
      if (K2 > K) qp[m * K2 + K] = 0;
    }
  });
  return q;
}

}  // namespace

namespace gptforge_wo {

// x [M, K] fp32; wp packed int8 [ceil(N/8), K2 * 8] (see the file's comment); w_scale [N] or [1].
at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& w_scale,
                     const c10::optional<at::Tensor>& bias, double step, int64_t N, int64_t qmax, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous fp32 [rows, K]");
  const int64_t M = x.size(0), K = x.size(1), K2 = K + (K & 1), NB = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(N > 0 && wp.dim() == 2 && wp.scalar_type() == at::kChar && wp.is_contiguous() && wp.size(0) == NB &&
                  wp.size(1) == K2 * kPanel,
              "wp: packed int8 [", NB, ", ", K2 * kPanel, "] for N ", N, " and K ", K);
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
                  (w_scale.numel() == N || w_scale.numel() == 1),
              "w_scale: fp32 [N] or [1]");
  TORCH_CHECK(step > 0 && std::isfinite(step), "step must be positive and finite");
  TORCH_CHECK(qmax >= 1 && qmax <= 32767, "qmax must be in 1..32767");
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run ISA path ", isa);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float s = static_cast<float>(step);
  const at::Tensor q = quantize_rows(x, K2, 1.0f / s, static_cast<float>(qmax), isa);
  std::vector<float> c(NB * kPanel, 0.f), b;
  const float* ws = w_scale.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) c[n] = s * ws[w_scale.numel() == 1 ? 0 : n];
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias: fp32 [N]");
    b.assign(NB * kPanel, 0.f);
    std::copy(bias->data_ptr<float>(), bias->data_ptr<float>() + N, b.begin());
  }
  const Operands o{wp.data_ptr<int8_t>(), q.data_ptr<int16_t>(), c.data(), b.empty() ? nullptr : b.data(),
                   y.data_ptr<float>(), M, N, K2 / 2, NB,
                   // a pair adds at most 2 * 127 * qmax to an int32 lane
                   std::max<int64_t>(1, INT32_MAX / (2 * 127 * qmax))};
  if (isa == kScalar) {
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) { panels_scalar(o, b0, b1); });
    return y;
  }
  // One task: every row of some panel groups (the rows share each group's weights from L1);
  // ~128K multiply-adds per task at the least.
  const int64_t groups = (NB + kTilePanels - 1) / kTilePanels;
  const int64_t grain = std::max<int64_t>(1, 131072 / std::max<int64_t>(1, M * K2 * kPanel * kTilePanels));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) { groups_avx2(o, g0, g1); });
  return y;
}

}  // namespace gptforge_wo

TORCH_LIBRARY_FRAGMENT(gptforge_wo, m) {
  m.def("int8_rows(Tensor x, Tensor wp, Tensor w_scale, Tensor? bias, float step, int N, int qmax, int isa) -> Tensor",
        &gptforge_wo::int8_rows);
}
