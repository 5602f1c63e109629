// The one fixed reduction order that octet's CTA-wide reductions use, written for both sides: the
// CUDA block reduction and its exact CPU emulation. With kLanes lanes (threads of the CTA):
//   1. lane t folds elements t, t + kLanes, t + 2 kLanes, ... in increasing order into op's
//      identity;
//   2. a halving tree: for s = kLanes/2, kLanes/4, ..., 1: lane[t] = op(lane[t], lane[t + s])
//      for every t < s;
//   3. the result is lane[0].
// Both sides perform exactly these IEEE operations, so a CPU reference built on
// fixed_order_reduce() reproduces the CUDA kernel's bits whenever the folded values agree, and
// the kernel's result never depends on scheduling (DESIGN.md rule 3: no float atomics).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "octet/fp8/format.h"  // OCTET_HD

namespace octet::ops {

/// op(a, b) = a + b; identity +0.
struct SumOp {
  template <typename T>
  OCTET_HD static T identity() {
    return T(0);
  }
  template <typename T>
  OCTET_HD T operator()(T a, T b) const {
    return a + b;
  }
};

/// op(a, b) = fmaxf(a, b) (a NaN operand loses to a number); identity -inf.
struct MaxOp {
  template <typename T>
  OCTET_HD static T identity() {
    return -INFINITY;
  }
  OCTET_HD float operator()(float a, float b) const {
#if defined(__CUDA_ARCH__)
    return fmaxf(a, b);
#else
    return std::fmax(a, b);
#endif
  }
};

/// The CPU emulation: reduces load(0), ..., load(n - 1) in the fixed order above.
template <int kLanes, typename T, typename Op, typename Load>
T fixed_order_reduce(int64_t n, Op op, Load load) {
  static_assert(kLanes >= 64 && kLanes <= 1024 && (kLanes & (kLanes - 1)) == 0,
                "kLanes must be a power of two in [64, 1024] (one CTA of whole warps)");
  std::array<T, kLanes> lane;
  lane.fill(Op::template identity<T>());
  for (int64_t base = 0; base < n; base += kLanes) {
    const int count = n - base < kLanes ? static_cast<int>(n - base) : kLanes;
    for (int t = 0; t < count; ++t) lane[t] = op(lane[t], load(base + t));
  }
  for (int s = kLanes / 2; s > 0; s /= 2)
    for (int t = 0; t < s; ++t) lane[t] = op(lane[t], lane[t + s]);
  return lane[0];
}

#if defined(__CUDACC__)

/// Width of a warp, the span of the shuffle stages of the tree.
inline constexpr int kWarpSize = 32;

/// Steps 2-3 on the GPU: every thread of a CTA of exactly kLanes threads passes its lane value;
/// all threads get lane[0]. `shared` holds kLanes values. Contains __syncthreads(): call it from
/// every thread of the CTA.
template <int kLanes, typename T, typename Op>
__device__ T fixed_order_tree(T value, Op op, T* shared) {
  static_assert(kLanes >= 2 * kWarpSize && kLanes <= 1024 && (kLanes & (kLanes - 1)) == 0,
                "kLanes must be a power of two in [64, 1024] (one CTA of whole warps)");
  const int t = threadIdx.x;
  shared[t] = value;
  __syncthreads();
  for (int s = kLanes / 2; s >= kWarpSize; s /= 2) {
    if (t < s) shared[t] = op(shared[t], shared[t + s]);
    __syncthreads();
  }
  if (t < kWarpSize) {
    // Shuffle stages s = 16 .. 1: lane t gets op(v[t], v[t + s]), the same pairs as the tree
    // (lanes t >= s compute values nobody reads).
    T v = shared[t];
    for (int s = kWarpSize / 2; s > 0; s /= 2) v = op(v, __shfl_down_sync(0xFFFFFFFFu, v, s));
    if (t == 0) shared[0] = v;
  }
  __syncthreads();
  const T result = shared[0];
  __syncthreads();  // shared may be reused right after
  return result;
}

/// Steps 1-3 on the GPU for a CTA of exactly kLanes threads: reduces load(0..n-1).
template <int kLanes, typename T, typename Op, typename Load>
__device__ T fixed_order_reduce_block(int64_t n, Op op, Load load, T* shared) {
  T value = Op::template identity<T>();
  for (int64_t i = threadIdx.x; i < n; i += kLanes) value = op(value, load(i));
  return fixed_order_tree<kLanes>(value, op, shared);
}

#endif  // __CUDACC__

}  // namespace octet::ops
