// The instruction-set paths of gptforge's CPU kernels and the cpuid check that guards them.
#pragma once
#include <cstdint>

namespace gptforge_wo {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Whether this CPU can execute path `isa` (a path it cannot run would stop on an illegal instruction).
inline bool cpu_has(int64_t isa) {
  __builtin_cpu_init();
  if (isa == kAvx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == kScalar;
}

}  // namespace gptforge_wo
