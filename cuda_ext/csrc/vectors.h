// 256-bit vectors through GCC's vector extensions, for the CPU passes
// (powersgd_cpu.cpp, engine_cpu.cpp): one register in a function compiled for AVX2,
// two SSE registers in the baseline build. Loads and stores by memcpy (unaligned).
#pragma once

#include <cstdint>

namespace bagua_householder {
namespace vectors {

template <typename T>
struct VectorOf;
template <>
struct VectorOf<float> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct VectorOf<double> {
  typedef double type __attribute__((vector_size(32)));
};
template <typename T>
using Vec = typename VectorOf<T>::type;
template <typename T>
constexpr int64_t kLanes = 32 / sizeof(T);

template <typename T>
__attribute__((always_inline)) inline Vec<T> load(const T* p) {
  Vec<T> v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
__attribute__((always_inline)) inline void store(T* p, Vec<T> v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

#if defined(__x86_64__) && defined(__GNUC__)
// Whether this CPU runs the passes' variants compiled for AVX2 + FMA (asked once).
inline bool cpu_has_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

}  // namespace vectors
}  // namespace bagua_householder
