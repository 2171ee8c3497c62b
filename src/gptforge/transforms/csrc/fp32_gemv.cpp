// One-row fp32 GEMV in the summation order of the batch-invariant oneDNN kernel (issue #32).
//
// The decode backend runs every Linear through oneDNN's small-batch packed layout because a
// row's result there never depends on how many rows share the product (serve = generate, bit
// for bit). At one row that kernel is ~40% slower than a GEMV. Per output it sums in a simple,
// fixed order: the K inputs in chunks of 1024, each chunk a sequential fused multiply-add chain
// from zero, the chunk sums added in order, the bias last (benchmarks/fp32_gemv_order.py). This
// kernel keeps that order exactly: the weights are stored in blocks of 64 outputs x K (for each
// input k, 64 consecutive outputs' weights), one input is broadcast at a time and each vector
// lane is one output's own sequential FMA chain. FMA rounds once, whatever the vector width, so
// the scalar, AVX2 and AVX-512 paths give the same bits; so does any thread count, since one
// output is always computed by one task. The caller checks the bits against the packed kernel
// once per layer before using it (generate/backend.py): this file only reproduces an order.
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
#include <vector>

#include "cpu_isa.h"
#include "kernels.h"

namespace {

using gptforge_wo::cpu_has;
using gptforge_wo::kAvx2;
using gptforge_wo::kAvx512;

constexpr int64_t kBlock = 64;   // outputs per weight block
constexpr int64_t kChunk = 1024;  // inputs per FMA chain (the packed kernel's)

// out[0..63] = the block's 64 sums (bias not added); w: [K, 64] of one block.
void block_scalar(const float* w, const float* x, int64_t K, float* out) {
  float tot[kBlock], acc[kBlock];
  for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
    std::fill(acc, acc + kBlock, 0.f);
    const int64_t c1 = std::min(K, c0 + kChunk);
    for (int64_t k = c0; k < c1; ++k)
      for (int64_t j = 0; j < kBlock; ++j) acc[j] = std::fma(w[k * kBlock + j], x[k], acc[j]);
    for (int64_t j = 0; j < kBlock; ++j) tot[j] = c0 == 0 ? acc[j] : tot[j] + acc[j];
  }
  std::copy(tot, tot + kBlock, out);
}

__attribute__((target("avx2,fma"))) void block_avx2(const float* w, const float* x, int64_t K, float* out) {
  __m256 tot[8], acc[8];
  for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
    for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_ps();
    const int64_t c1 = std::min(K, c0 + kChunk);
    const float* row = w + c0 * kBlock;
    for (int64_t k = c0; k < c1; ++k, row += kBlock) {
      const __m256 xk = _mm256_set1_ps(x[k]);
      for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(_mm256_loadu_ps(row + 8 * v), xk, acc[v]);
    }
    for (int v = 0; v < 8; ++v) tot[v] = c0 == 0 ? acc[v] : _mm256_add_ps(tot[v], acc[v]);
  }
  for (int v = 0; v < 8; ++v) _mm256_storeu_ps(out + 8 * v, tot[v]);
}

__attribute__((target("avx512f,avx2,fma"))) void block_avx512(const float* w, const float* x, int64_t K,
                                                              float* out) {
  __m512 tot[4], acc[4];
  for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
    for (int v = 0; v < 4; ++v) acc[v] = _mm512_setzero_ps();
    const int64_t c1 = std::min(K, c0 + kChunk);
    const float* row = w + c0 * kBlock;
    for (int64_t k = c0; k < c1; ++k, row += kBlock) {
      const __m512 xk = _mm512_set1_ps(x[k]);
      for (int v = 0; v < 4; ++v) acc[v] = _mm512_fmadd_ps(_mm512_loadu_ps(row + 16 * v), xk, acc[v]);
    }
    for (int v = 0; v < 4; ++v) tot[v] = c0 == 0 ? acc[v] : _mm512_add_ps(tot[v], acc[v]);
  }
  for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + 16 * v, tot[v]);
}

// ---------------------------------------------------------------- several rows (fp32_rows)
// The same per-output order for R rows at once: every (row, output) is still its own sequential
// FMA chain over each chunk of 1024 inputs, the chunk sums added in order, so row r's bits are
// fp32_gemv's on row r whatever R is (batch-invariant by construction). What R rows gain is the
// weights' reuse: each weight vector loaded once feeds MR rows, a tile of MR rows x 32 (AVX2) or
// 64 (AVX-512) outputs lives in registers, and one chunk of a block (1024 x 64 floats, 256 KB)
// stays in L2 while every row tile passes over it.

// Each tile: accumulators of MR rows x 4 vectors, resumed from `tot` unless `first`, the chains run
// over inputs [c0, c1), stored back. The accumulators are named variables (GF_ROW): an array of
// vectors is kept in memory by GCC, a load and store per FMA (2x slower).
#define GF_ACC(V, m) V a##m##0, a##m##1, a##m##2, a##m##3
#define GF_INIT(m, ZERO, LOAD, W)                                                                    \
  if (MR > m) {                                                                                   \
    float* t = tot + m * ldt + j0;                                                                \
    a##m##0 = first ? ZERO() : LOAD(t), a##m##1 = first ? ZERO() : LOAD(t + W);                    \
    a##m##2 = first ? ZERO() : LOAD(t + 2 * W), a##m##3 = first ? ZERO() : LOAD(t + 3 * W);        \
  }
#define GF_ROW(m, SET1, FMA)                                                                        \
  if (MR > m) {                                                                                   \
    const auto xk = SET1(x[m * ldx + k]);                                                         \
    a##m##0 = FMA(w0, xk, a##m##0), a##m##1 = FMA(w1, xk, a##m##1);                                \
    a##m##2 = FMA(w2, xk, a##m##2), a##m##3 = FMA(w3, xk, a##m##3);                                \
  }
#define GF_STORE(m, STORE, W)                                                                       \
  if (MR > m) {                                                                                   \
    float* t = tot + m * ldt + j0;                                                                \
    STORE(t, a##m##0), STORE(t + W, a##m##1), STORE(t + 2 * W, a##m##2), STORE(t + 3 * W, a##m##3); \
  }

template <int MR>  // MR <= 3: 12 accumulators + 4 weights of the 16 registers
__attribute__((target("avx2,fma"))) void tile_avx2(const float* w, const float* x, int64_t ldx, int64_t c0,
                                                   int64_t c1, int j0, float* tot, int64_t ldt, bool first) {
  GF_ACC(__m256, 0); GF_ACC(__m256, 1); GF_ACC(__m256, 2);
  GF_INIT(0, _mm256_setzero_ps, _mm256_loadu_ps, 8) GF_INIT(1, _mm256_setzero_ps, _mm256_loadu_ps, 8)
  GF_INIT(2, _mm256_setzero_ps, _mm256_loadu_ps, 8)
  const float* row = w + c0 * kBlock + j0;
  for (int64_t k = c0; k < c1; ++k, row += kBlock) {
    const __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8), w2 = _mm256_loadu_ps(row + 16),
                 w3 = _mm256_loadu_ps(row + 24);
    GF_ROW(0, _mm256_set1_ps, _mm256_fmadd_ps) GF_ROW(1, _mm256_set1_ps, _mm256_fmadd_ps)
    GF_ROW(2, _mm256_set1_ps, _mm256_fmadd_ps)
  }
  GF_STORE(0, _mm256_storeu_ps, 8) GF_STORE(1, _mm256_storeu_ps, 8) GF_STORE(2, _mm256_storeu_ps, 8)
}

template <int MR>  // MR <= 6: 24 accumulators + 4 weights of the 32 registers
__attribute__((target("avx512f,avx2,fma"))) void tile_avx512(const float* w, const float* x, int64_t ldx, int64_t c0,
                                                             int64_t c1, int j0, float* tot, int64_t ldt, bool first) {
  GF_ACC(__m512, 0); GF_ACC(__m512, 1); GF_ACC(__m512, 2); GF_ACC(__m512, 3); GF_ACC(__m512, 4); GF_ACC(__m512, 5);
  GF_INIT(0, _mm512_setzero_ps, _mm512_loadu_ps, 16) GF_INIT(1, _mm512_setzero_ps, _mm512_loadu_ps, 16)
  GF_INIT(2, _mm512_setzero_ps, _mm512_loadu_ps, 16) GF_INIT(3, _mm512_setzero_ps, _mm512_loadu_ps, 16)
  GF_INIT(4, _mm512_setzero_ps, _mm512_loadu_ps, 16) GF_INIT(5, _mm512_setzero_ps, _mm512_loadu_ps, 16)
  const float* row = w + c0 * kBlock + j0;
  for (int64_t k = c0; k < c1; ++k, row += kBlock) {
    const __m512 w0 = _mm512_loadu_ps(row), w1 = _mm512_loadu_ps(row + 16), w2 = _mm512_loadu_ps(row + 32),
                 w3 = _mm512_loadu_ps(row + 48);
    GF_ROW(0, _mm512_set1_ps, _mm512_fmadd_ps) GF_ROW(1, _mm512_set1_ps, _mm512_fmadd_ps)
    GF_ROW(2, _mm512_set1_ps, _mm512_fmadd_ps) GF_ROW(3, _mm512_set1_ps, _mm512_fmadd_ps)
    GF_ROW(4, _mm512_set1_ps, _mm512_fmadd_ps) GF_ROW(5, _mm512_set1_ps, _mm512_fmadd_ps)
  }
  GF_STORE(0, _mm512_storeu_ps, 16) GF_STORE(1, _mm512_storeu_ps, 16) GF_STORE(2, _mm512_storeu_ps, 16)
  GF_STORE(3, _mm512_storeu_ps, 16) GF_STORE(4, _mm512_storeu_ps, 16) GF_STORE(5, _mm512_storeu_ps, 16)
}
#undef GF_ACC
#undef GF_INIT
#undef GF_ROW
#undef GF_STORE

void tile_scalar(const float* w, const float* x, int64_t ldx, int64_t c0, int64_t c1, float* tot, int64_t ldt,
                 bool first, int64_t rows) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < kBlock; ++j) {
      float acc = first ? 0.f : tot[m * ldt + j];
      for (int64_t k = c0; k < c1; ++k) acc = std::fma(w[k * kBlock + j], x[m * ldx + k], acc);
      tot[m * ldt + j] = acc;
    }
}

// tot [rows, 64] = the block's sums for rows x[0..rows) (bias not added); acc [rows, 64]: scratch.
// Each chunk's chains run over sub-chunks of kSub inputs, the accumulators stored and reloaded in
// between (no rounding: the chain is unchanged), so that the weights of one sub-chunk (kSub x 32
// or 64 floats) stay in L1 while every row tile passes over them.
constexpr int64_t kSub = 128;

// The weights that follow a sub-chunk in memory (the rest of its block, then the next block) are
// what the next sub-chunk reads: with `ahead` they are prefetched into L2 a few cache lines before
// each row tile, so that no sub-chunk starts stalled on memory. Measured on Zen 3 (2 threads,
// benchmarks/results/2026-11-27-rows-prefetch.md): the 50304 x 768 head 1.04-1.28x faster at 8-64
// rows, the block Linears 1.0-1.2x at 21-64 rows but 0.75-0.95x at 2-8 (weights that stay in
// cache gain nothing there and the prefetches cost issue slots); fp32_rows decides. A prefetch
// is only a hint: it changes no result and never faults past the tensor's end.
struct Ahead {
  const char* p;
  const char* end;
  int64_t per;  // cache lines per call
  void operator()() {
    for (int64_t i = 0; i < per && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  }
};

Ahead ahead_of(bool on, const float* w, int64_t s0, int64_t s1, int64_t tiles) {
  const char* p = reinterpret_cast<const char*>(w + s1 * kBlock);
  const int64_t lines = on ? (s1 - s0) * kBlock * static_cast<int64_t>(sizeof(float)) / 64 : 0;
  return {p, p + lines * 64, (lines + tiles - 1) / std::max<int64_t>(1, tiles)};
}

void block_rows(const float* w, const float* x, int64_t K, int64_t rows, float* tot, float* acc, int64_t isa,
                bool ahead_on) {
  for (int64_t c0 = 0; c0 < K; c0 += kChunk) {
    const int64_t c1 = std::min(K, c0 + kChunk);
    float* dst = c0 == 0 ? tot : acc;  // the first chunk's sums are the running total itself
    for (int64_t s0 = c0; s0 < c1; s0 += kSub) {
      const int64_t s1 = std::min(c1, s0 + kSub);
      const bool first = s0 == c0;
      if (isa == kAvx512) {
        Ahead ahead = ahead_of(ahead_on, w, s0, s1, rows / 6 + (rows % 6) / 2 + rows % 2);
        int64_t m = 0;
        for (; m + 6 <= rows; m += 6)
          ahead(), tile_avx512<6>(w, x + m * K, K, s0, s1, 0, dst + m * kBlock, kBlock, first);
        for (; m + 2 <= rows; m += 2)
          ahead(), tile_avx512<2>(w, x + m * K, K, s0, s1, 0, dst + m * kBlock, kBlock, first);
        for (; m < rows; ++m) ahead(), tile_avx512<1>(w, x + m * K, K, s0, s1, 0, dst + m * kBlock, kBlock, first);
      } else if (isa == kAvx2) {
        Ahead ahead = ahead_of(ahead_on, w, s0, s1, 2 * (rows / 3 + (rows % 3) / 2 + rows % 3 % 2));
        for (int j0 = 0; j0 < kBlock; j0 += 32) {
          int64_t m = 0;
          for (; m + 3 <= rows; m += 3)
            ahead(), tile_avx2<3>(w, x + m * K, K, s0, s1, j0, dst + m * kBlock, kBlock, first);
          for (; m + 2 <= rows; m += 2)
            ahead(), tile_avx2<2>(w, x + m * K, K, s0, s1, j0, dst + m * kBlock, kBlock, first);
          for (; m < rows; ++m) ahead(), tile_avx2<1>(w, x + m * K, K, s0, s1, j0, dst + m * kBlock, kBlock, first);
        }
      } else {
        tile_scalar(w, x, K, s0, s1, dst, kBlock, first, rows);
      }
    }
    if (c0 > 0)  // the chunk sums added in order
      for (int64_t i = 0; i < rows * kBlock; ++i) tot[i] += acc[i];
  }
}

// Both entry points' checks of the block weights, N, the bias and the path: (blocks, K, bias or null).
struct Blocks {
  int64_t NB, K;
  const float* bias;
};

Blocks checked_blocks(const at::Tensor& wb, const c10::optional<at::Tensor>& bias, int64_t N, int64_t isa) {
  TORCH_CHECK(wb.dim() == 3 && wb.size(2) == kBlock && wb.scalar_type() == at::kFloat && wb.is_contiguous(),
              "wb: contiguous fp32 [blocks, K, 64]");
  const int64_t NB = wb.size(0), K = wb.size(1);
  TORCH_CHECK(N > 0 && (N + kBlock - 1) / kBlock == NB, "N ", N, " does not match ", NB, " blocks");
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run ISA path ", isa);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias: fp32 [N]");
    bp = bias->data_ptr<float>();
  }
  return {NB, K, bp};
}

}  // namespace

// The entry point (kernels.h: the fused decode step calls it directly).
namespace gptforge_wo {

// x: fp32 with K elements (any shape whose last dim is K and one row); wb: [ceil(N/64), K, 64].
at::Tensor fp32_gemv(const at::Tensor& wb, const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t N,
                     int64_t isa) {
  const Blocks b = checked_blocks(wb, bias, N, isa);
  const int64_t NB = b.NB, K = b.K;
  const float* bp = b.bias;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == K && x.size(-1) == K,
              "x: one contiguous fp32 row of ", K);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, x.options());
  const float* w = wb.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  auto kernel = isa == kAvx512 ? block_avx512 : isa == kAvx2 ? block_avx2 : block_scalar;
  // ~64K multiply-adds per task; the order inside one output never depends on the split.
  const int64_t grain = std::max<int64_t>(1, 1024 / std::max<int64_t>(1, K));
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float buf[kBlock];
    for (int64_t nb = b0; nb < b1; ++nb) {
      kernel(w + nb * K * kBlock, xp, K, buf);
      const int64_t n0 = nb * kBlock, n = std::min(kBlock, N - n0);
      for (int64_t j = 0; j < n; ++j) o[n0 + j] = bp ? buf[j] + bp[n0 + j] : buf[j];
    }
  });
  return out;
}

// x: [R, K] fp32 rows; the result [R, N] equals fp32_gemv on each row, bit for bit.
at::Tensor fp32_rows(const at::Tensor& wb, const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t N,
                     int64_t isa) {
  const Blocks b = checked_blocks(wb, bias, N, isa);
  const int64_t NB = b.NB, K = b.K;
  const float* bp = b.bias;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == K,
              "x: contiguous fp32 [rows, ", K, "]");
  const int64_t R = x.size(0);
  at::Tensor out = at::empty({R, N}, x.options());
  if (R == 0) return out;
  const float* w = wb.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // One task: all rows of some blocks (the rows share each block's weights); ~256K multiply-adds.
  const int64_t grain = std::max<int64_t>(1, 262144 / std::max<int64_t>(1, K * kBlock * R));
  // Prefetching pays where the rows keep the cores busy long enough to hide it, or where the
  // weights cannot stay in any cache (see Ahead).
  const bool ahead = R >= 16 || NB * K * kBlock * static_cast<int64_t>(sizeof(float)) > (int64_t{64} << 20);
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> tot(static_cast<size_t>(R * kBlock)), acc(K > kChunk ? tot.size() : 0);
    for (int64_t nb = b0; nb < b1; ++nb) {
      block_rows(w + nb * K * kBlock, xp, K, R, tot.data(), acc.data(), isa, ahead);
      const int64_t n0 = nb * kBlock, n = std::min(kBlock, N - n0);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < n; ++j) o[r * N + n0 + j] = bp ? tot[r * kBlock + j] + bp[n0 + j] : tot[r * kBlock + j];
    }
  });
  return out;
}

// x: [R, K] rows; w: the row-major [V, K] weight the blocks were made of; cols: int64 [C] -> [R, C],
// each the value fp32_gemv / fp32_rows give for output cols[c]: the same block kernel over a block
// gathered from those columns (the LM head screen's candidates, transforms/head_screen.py).
at::Tensor fp32_columns(const at::Tensor& w, const at::Tensor& x, const at::Tensor& cols, int64_t isa) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w: contiguous fp32 [V, K]");
  const int64_t V = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == K,
              "x: contiguous fp32 [rows, ", K, "]");
  TORCH_CHECK(cols.dim() == 1 && cols.scalar_type() == at::kLong && cols.is_contiguous(), "cols: int64 [C]");
  TORCH_CHECK(cpu_has(isa), "this CPU cannot run ISA path ", isa);
  const int64_t R = x.size(0), C = cols.size(0);
  const int64_t* cp = cols.data_ptr<int64_t>();
  for (int64_t c = 0; c < C; ++c) TORCH_CHECK(cp[c] >= 0 && cp[c] < V, "column ", cp[c], " outside [0, ", V, ")");
  at::Tensor out = at::empty({R, C}, x.options());
  const float* wp = w.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  auto kernel = isa == kAvx512 ? block_avx512 : isa == kAvx2 ? block_avx2 : block_scalar;
  at::parallel_for(0, (C + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> blk(static_cast<size_t>(K * kBlock));
    alignas(64) float buf[kBlock];
    for (int64_t nb = b0; nb < b1; ++nb) {
      const int64_t c0 = nb * kBlock, n = std::min(kBlock, C - c0);
      std::fill(blk.begin(), blk.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float* src = wp + cp[c0 + j] * K;
        for (int64_t k = 0; k < K; ++k) blk[k * kBlock + j] = src[k];
      }
      for (int64_t r = 0; r < R; ++r) {
        kernel(blk.data(), xp + r * K, K, buf);
        std::copy(buf, buf + n, o + r * C + c0);
      }
    }
  });
  return out;
}

}  // namespace gptforge_wo

TORCH_LIBRARY_FRAGMENT(gptforge_wo, m) {
  m.def("fp32_columns(Tensor w, Tensor x, Tensor cols, int isa) -> Tensor", &gptforge_wo::fp32_columns);
  m.def("fp32_gemv(Tensor wb, Tensor x, Tensor? bias, int N, int isa) -> Tensor", &gptforge_wo::fp32_gemv);
  m.def("fp32_rows(Tensor wb, Tensor x, Tensor? bias, int N, int isa) -> Tensor", &gptforge_wo::fp32_rows);
}
