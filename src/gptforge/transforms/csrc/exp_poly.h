// The kernels' float32 exponential (gelu.cpp, decode_attention.cpp): 2^n times a degree-7 Taylor
// polynomial of e^r on |r| <= ln2/2 (truncation error < 1e-8 relative), its input clamped to
// [-87, 88] so 2^n stays a normal float. The vector forms (simd_avx2.inc / simd_avx512.inc, `vexp`)
// run the same operations per lane (fused multiply-adds where one is written, one rounding each),
// so every path gives an element the same bits wherever it sits (a NaN stays NaN on all of them).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace gptforge_wo {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2Hi = 0.693145751953125f;  // ln 2 split: n * kLn2Hi is exact for |n| < 2^9
constexpr float kLn2Lo = 1.428606765330187e-06f;
constexpr float kExpMin = -87.0f, kExpMax = 88.0f;
// 1/k! for k = 7 .. 0: e^r = ((..(c7 r + c6) r + ..) r + c0
constexpr float kExpC[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

inline float exp_poly(float x) {
  if (x != x) return x;  // NaN stays NaN, as the vector forms' max / min pass it on
  const float t = std::min(kExpMax, std::max(kExpMin, x));
  const float n = std::nearbyint(t * kLog2e);
  const float r = std::fma(n, -kLn2Lo, std::fma(n, -kLn2Hi, t));
  float p = kExpC[0];
  for (int i = 1; i < 8; ++i) p = std::fma(p, r, kExpC[i]);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace gptforge_wo
