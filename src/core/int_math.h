// Integer rounding for sizes, tiles and grids: one definition for the CPU and CUDA backends, usable
// on the host, in kernels and in constant expressions.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define OCTET_INT_HD __host__ __device__
#else
#define OCTET_INT_HD
#endif

namespace octet {

/// a / b rounded up (a >= 0, b > 0).
OCTET_INT_HD constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
/// a rounded up to a multiple of b (a >= 0, b > 0).
OCTET_INT_HD constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

}  // namespace octet

#undef OCTET_INT_HD
