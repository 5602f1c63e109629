// Grid arithmetic shared by the GEMM families' small elementwise kernels (one thread per element,
// 1-D grids of kThreadsPerBlock threads).
#pragma once

#include <cstdint>

#include "octet/core/error.h"

namespace octet::ops::cuda {

inline constexpr int kThreadsPerBlock = 256;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

/// Blocks for one thread per element over n elements; throws past the 1-D grid limit.
inline unsigned int grid_for(int64_t n) {
  const int64_t blocks = ceil_div(n, kThreadsPerBlock);
  OCTET_CHECK(blocks <= INT32_MAX, "kernel over ", n, " elements exceeds the 1-D grid limit");
  return static_cast<unsigned int>(blocks);
}

__device__ __forceinline__ int64_t global_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

}  // namespace octet::ops::cuda
