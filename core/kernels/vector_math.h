// Float vectors and math in forms GCC vectorizes without -ffast-math, shared by specdec's
// CPU kernels (their sources include it; the build's name carries its hash).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace specdec_cpu {

// LANES floats as one value of GCC's vector extension: one register, 16 floats where the
// machine has AVX-512, else 8 (AVX2: the reductions' shuffles across the two halves of a
// 16-lane vector took most of the kernel's time there: a 12-token verification over 500
// keys cost 1.5 ms a layer against 0.64 with 8 lanes, scripts/bench_attention_kernel.py).
#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
#else
constexpr int64_t LANES = 8;
#endif

typedef float lanes_t __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t lane_index_t __attribute__((vector_size(LANES * sizeof(int32_t))));

inline lanes_t load_lanes(const float* p) {
  lanes_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_lanes(float* p, lanes_t v) { std::memcpy(p, &v, sizeof(v)); }

// the LANES partial sums added pairwise: lane l + LANES/2 into lane l, then l + LANES/4, ..., l + 1
inline float reduce_lanes(lanes_t v) {
#if defined(__AVX512F__)
  v += __builtin_shuffle(v, lane_index_t{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, lane_index_t{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, lane_index_t{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, lane_index_t{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
  v += __builtin_shuffle(v, lane_index_t{4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, lane_index_t{2, 3, 0, 1, 6, 7, 4, 5});
  v += __builtin_shuffle(v, lane_index_t{1, 0, 3, 2, 5, 4, 7, 6});
#endif
  return v[0];
}

// exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2, a degree-6 polynomial), in a
// form the compiler vectorizes; below -87 it gives 2^-126 instead of a subnormal.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(float));
  return y * scale;
}

}  // namespace specdec_cpu
