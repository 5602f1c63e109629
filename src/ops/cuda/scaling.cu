// CUDA backend of the scaling family: the delayed-scaling history update of many groups in one
// launch, and current scaling. Bit-exact with the CPU reference (src/ops/cpu/scaling.cc): the same
// float operations in the same order, and the same NaN rule for the history maximum.
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "octet/core/cuda_context.h"
#include "octet/core/device.h"
#include "octet/fp8/format.h"
#include "ops/cuda/launch_util.cuh"
#include "ops/scaling_backend.h"

namespace octet::ops::cuda {
namespace scaling {
namespace {

/// Groups per launch of the update kernel; more are split into several launches. 256 group
/// descriptors (64 B each) are 16 KiB of kernel parameters, within the 32764 B that CUDA 12.1+
/// allows on sm_70+.
constexpr int kMaxGroupsPerLaunch = 256;
/// One CTA per group; each warp owns columns j = warp, warp + 4, ... of the group's history.
constexpr int kUpdateThreads = 128;
constexpr int kUpdateWarps = kUpdateThreads / kWarpSize;
/// History rows each lane moves per step of the roll: 8 loads in flight per lane.
constexpr int kRollRowsPerLane = 8;
constexpr int kRollRows = kRollRowsPerLane * kWarpSize;

/// Float bits that survive rounding down to a power of two: sign and exponent (IEEE binary32).
constexpr uint32_t kSignExponentMask = 0xFF800000u;
constexpr uint32_t kExponentMask = 0x7F800000u;

/// One group of update_delayed_scaling, as raw pointers.
struct DelayedGroup {
  float* history;      ///< [len, n]
  const float* scale;  ///< [n], the current scales
  float* next_scale;   ///< [n], the new scales (may be `scale`)
  float* scale_inv;    ///< [n]
  float* last_amax;    ///< [n] or nullptr: row 0 before the roll
  int64_t len, n;
  float fp8_max;
};

/// Up to kMaxGroupsPerLaunch groups, passed by value as one kernel parameter.
struct DelayedBatch {
  DelayedGroup groups[kMaxGroupsPerLaunch];
};
static_assert(sizeof(DelayedBatch) + 16 <= 32764, "kernel parameters are limited to 32764 bytes");

// The scalar rules of src/ops/cpu/scaling.cc, on the device.

/// A finite, positive amax gives a new scale; 0, inf, NaN (and negatives) keep the old one.
__device__ __forceinline__ bool usable_amax(float amax) {
  return (fp8::float_bits(amax) & kExponentMask) != kExponentMask && amax > 0.0f;
}

/// An overflowed scale (amax tiny) becomes the largest finite float.
__device__ __forceinline__ float clamp_infinite(float scale) {
  return (fp8::float_bits(scale) & 0x7FFFFFFFu) == kExponentMask ? FLT_MAX : scale;
}

/// max for the history reduction: NaN when either is NaN (the CPU's history_amax lets a NaN
/// anywhere win, so the old scale is kept), else the larger. Where the result is usable (finite,
/// positive) it is exactly the CPU's value, whatever the reduction order.
__device__ __forceinline__ float nan_max(float a, float b) {
  if (a != a) return a;
  if (b != b) return b;
  return fmaxf(a, b);
}

// ----------------------------------------------------------------------------
// CUDA kernels

/// Delayed-scaling update; blockIdx.x = group. Per column j: amax = max over the history (or
/// row 0), scale = (fp8_max / amax) * 2^-margin clamped to FLT_MAX (old scale when amax is not
/// usable), scale_inv = 1 / scale; then the column rolls down one row and row 0 becomes 0.
/// Traffic is 3 passes over a small history (read, read + write); latency-bound, not a bandwidth
/// kernel: a few microseconds for 1024-row histories.
__global__ void __launch_bounds__(kUpdateThreads)
    update_delayed_scaling_kernel(const __grid_constant__ DelayedBatch batch, float margin_factor,
                                  bool most_recent) {
  const DelayedGroup& g = batch.groups[blockIdx.x];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  for (int64_t j = warp; j < g.n; j += kUpdateWarps) {
    float* column = g.history + j;  // row i at column[i * n]
    const float row0 = column[0];
    float amax = row0;
    if (!most_recent) {
      float m = -INFINITY;
      for (int64_t i = lane; i < g.len; i += kWarpSize) m = nan_max(m, column[i * g.n]);
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
        m = nan_max(m, __shfl_xor_sync(kFullMask, m, offset));
      amax = m;
    }
    if (lane == 0) {
      float s = g.scale[j];
      if (usable_amax(amax)) s = clamp_infinite(g.fp8_max / amax * margin_factor);
      g.next_scale[j] = s;
      g.scale_inv[j] = 1.0f / s;
      if (g.last_amax != nullptr) g.last_amax[j] = row0;
    }
    // Roll: row i takes row i - 1, bottom-up in steps of kRollRows rows. A step reads rows
    // [base - 1, base + kRollRows - 1) and writes [base, base + kRollRows): the __syncwarp()
    // orders all of its reads (and the amax reads above) before its writes, and the next,
    // lower step writes row base - 1 only after its own __syncwarp().
    for (int64_t base = (g.len - 1) / kRollRows * kRollRows; base >= 0; base -= kRollRows) {
      float v[kRollRowsPerLane];
#pragma unroll
      for (int u = 0; u < kRollRowsPerLane; ++u) {
        const int64_t i = base + u * kWarpSize + lane;
        v[u] = (i >= 1 && i < g.len) ? column[(i - 1) * g.n] : 0.0f;  // row 0 becomes 0
      }
      __syncwarp();
#pragma unroll
      for (int u = 0; u < kRollRowsPerLane; ++u) {
        const int64_t i = base + u * kWarpSize + lane;
        if (i < g.len) column[i * g.n] = v[u];
      }
    }
  }
}

/// Current scaling of one tensor: scale = fp8_max / amax (1 when amax is not usable, FLT_MAX on
/// overflow), optionally rounded down to a power of two; scale_inv = 1 / scale. One thread.
__global__ void compute_current_scale_kernel(const float* amax, float* scale, float* scale_inv,
                                             float fp8_max, bool power_of_2) {
  const float a = *amax;
  float s = usable_amax(a) ? clamp_infinite(fp8_max / a) : 1.0f;
  // s is a positive normal float here, so clearing the mantissa gives 2^floor(log2(s)).
  if (power_of_2) s = fp8::bits_float(fp8::float_bits(s) & kSignExponentMask);
  *scale = s;
  *scale_inv = 1.0f / s;
}

}  // namespace
}  // namespace scaling

// ----------------------------------------------------------------------------
// Kernel launchers

void update_delayed_scaling(const ScalingGroup* groups, int count, int margin, fp8::AmaxAlgo algo) {
  if (count <= 0) return;
  const Device device = groups[0].amax_history.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  // 2^-margin, exact (the dispatcher bounds margin so that it is a nonzero float); computed on
  // the host with the CPU reference's expression.
  const float margin_factor = std::ldexp(1.0f, -margin);
  for (int first = 0; first < count; first += scaling::kMaxGroupsPerLaunch) {
    const int batch_count = std::min(scaling::kMaxGroupsPerLaunch, count - first);
    scaling::DelayedBatch batch{};
    for (int k = 0; k < batch_count; ++k) {
      const ScalingGroup& group = groups[first + k];
      const Tensor& next_scale = group.next_scale.defined() ? group.next_scale : group.scale;
      batch.groups[k] = {
          static_cast<float*>(group.amax_history.raw_data()),
          static_cast<const float*>(group.scale.raw_data()),
          static_cast<float*>(next_scale.raw_data()),
          static_cast<float*>(group.scale_inv.raw_data()),
          group.last_amax.defined() ? static_cast<float*>(group.last_amax.raw_data()) : nullptr,
          group.amax_history.size(0),
          group.amax_history.size(1),
          group.fp8_max};
    }
    scaling::update_delayed_scaling_kernel<<<batch_count, scaling::kUpdateThreads, 0, stream>>>(
        batch, margin_factor, algo == fp8::AmaxAlgo::most_recent);
    OCTET_CHECK_LAUNCH();
  }
}

void compute_current_scale(const Tensor& amax, const Tensor& scale, const Tensor& scale_inv,
                           float fp8_max, bool power_of_2) {
  const Device device = amax.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  scaling::compute_current_scale_kernel<<<1, 1, 0, stream>>>(
      static_cast<const float*>(amax.raw_data()), static_cast<float*>(scale.raw_data()),
      static_cast<float*>(scale_inv.raw_data()), fp8_max, power_of_2);
  OCTET_CHECK_LAUNCH();
}

}  // namespace octet::ops::cuda
