// Launch arithmetic shared by the CUDA backends: the warp and grid limits every family uses,
// ceil_div and round_up (from core/int_math.h), grids of the GEMM families' small elementwise
// kernels (one thread per element, 1-D grids of kThreadsPerBlock threads), and the limit on what
// a launch may pass in its parameters, and the once-per-device opt-in to more than 48 KiB of
// dynamic shared memory. CUDA sources only (.cu and .cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/int_math.h"
#include "octet/core/cuda_context.h"
#include "octet/core/error.h"
#include "ops/sorted_search.h"

namespace octet::ops::cuda {

inline constexpr int kWarpSize = 32;
/// Every lane of a warp, for the __shfl_*_sync and __reduce_*_sync intrinsics.
inline constexpr unsigned kFullMask = 0xFFFFFFFFu;
/// The largest gridDim.y (CUDA Programming Guide, "Compute Capabilities": 65535).
inline constexpr int64_t kMaxGridY = 65535;

inline constexpr int kThreadsPerBlock = 256;

/// Bytes of parameters one kernel launch may take: 32,764 since CUDA 12.1 on Volta and newer
/// (CUDA C++ Programming Guide, "Function Parameters"); octet builds for sm_90 with CUDA 13. The
/// multi-tensor kernels pass their lists by value up to this size, so a launch needs no
/// descriptor table uploaded first.
inline constexpr size_t kMaxKernelParamBytes = 32764;

/// Dynamic shared memory a kernel may use without opting in (all architectures since sm_70).
inline constexpr size_t kDefaultDynamicSmemBytes = 48 * 1024;

/// Lets `kernel` take up to `bytes` of dynamic shared memory on `device`, preferring all of L1 as
/// shared memory (a kernel that stages its reads reuses nothing through L1, and the carveout must
/// not limit its CTAs an SM). Done once per device, recorded in `opted_in`, the launch site's
/// static flag: cudaFuncSetAttribute applies to the current device, which the ops' entries set.
template <typename Kernel>
void opt_in_shared_memory(Kernel kernel, size_t bytes, const Device& device,
                          octet::cuda::PerDeviceFlag& opted_in) {
  if (opted_in.test(device)) return;
  OCTET_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  OCTET_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
  opted_in.set(device);
}

/// Blocks for one thread per element over n elements; throws past the 1-D grid limit.
inline unsigned int grid_for(int64_t n) {
  const int64_t blocks = ceil_div(n, kThreadsPerBlock);
  OCTET_CHECK(blocks <= INT32_MAX, "kernel over ", n, " elements exceeds the 1-D grid limit");
  return static_cast<unsigned int>(blocks);
}

/// The entry of a multi-tensor launch that CTA `block` works on: entry j owns the CTAs
/// [first[j], first[j + 1]), so it is the last j < count with first[j] <= block (first strictly
/// increases: every entry has at least one CTA). A binary search, uniform over the CTA.
__device__ __forceinline__ int owning_entry(const int32_t* first, int count, int block) {
  return static_cast<int>(last_start_at_most(first, count, block));
}

__device__ __forceinline__ int64_t global_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

}  // namespace octet::ops::cuda
