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

/// Steps 1-3 for one warp instead of a CTA of kLanes threads: the same values, folds and tree
/// pairs, so the same bits as fixed_order_reduce_block, with no shared memory and no barrier. The
/// warp takes the n elements in strips of one kN-element pack per lane, strip q covering elements
/// [q kStrip, q kStrip + kStrip). Element c belongs to lane value t = c mod kLanes and is its
/// (c / kLanes)-th term, so a lane l holds kSlots of the kLanes values, slot g kN + k being
/// t = g kStrip + kN l + k; strips come in increasing order, so each value folds its terms in
/// order. reduce() runs the tree's stages lane[t] = op(lane[t], lane[t + s]), each as a register
/// op (the partner in the same lane) or a shuffle (the partner s / kN lanes down).
template <int kLanes, int kN, typename Op>
struct WarpFold {
  static constexpr int kStrip = kWarpSize * kN;
  static constexpr int kGroups = kLanes / kStrip;
  static constexpr int kSlots = kGroups * kN;
  static_assert(kLanes % kStrip == 0, "a strip must divide the lanes of the fixed order");

  float slot[kSlots];

  __device__ WarpFold() {
#pragma unroll
    for (int j = 0; j < kSlots; ++j) slot[j] = Op::template identity<float>();
  }

  /// Folds this lane's terms of strip q (a pack inside the n elements).
  __device__ void add(int64_t q, const float (&term)[kN]) {
    const int g = static_cast<int>(q % kGroups);
#pragma unroll
    for (int k = 0; k < kN; ++k) {
#pragma unroll
      for (int gg = 0; gg < kGroups; ++gg)  // a constant slot index keeps slot in registers
        if (gg == g) slot[gg * kN + k] = Op{}(slot[gg * kN + k], term[k]);
    }
  }

  /// The sum, in lane 0. Every lane of the warp must call it.
  __device__ float reduce() {
#pragma unroll
    for (int s = kLanes / 2; s >= 1; s /= 2) {
      if (s >= kStrip || s < kN) {  // the partner is slot j + step of the same lane
        const int step = s >= kStrip ? (s / kStrip) * kN : s;
#pragma unroll
        for (int j = 0; j + step < kSlots; ++j) slot[j] = Op{}(slot[j], slot[j + step]);
      } else {  // the partner is the same slot s / kN lanes down
#pragma unroll
        for (int j = 0; j < kSlots; ++j)
          slot[j] = Op{}(slot[j], __shfl_down_sync(0xFFFFFFFFu, slot[j], s / kN));
      }
    }
    return slot[0];
  }
};

#endif  // __CUDACC__

}  // namespace octet::ops
