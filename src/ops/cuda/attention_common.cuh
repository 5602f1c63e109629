// What the CUDA attention files share (attention.cu, attention_flash.cu, attention_simple.cu,
// rope.cu): the limits of the simple path, the element and warp helpers of the CUDA-core kernels,
// the test that picks the tensor-core path, and the entry points of each path. CUDA sources only.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "octet/core/error.h"
#include "octet/fp8/format.h"
#include "octet/ops/attention.h"
#include "ops/cuda/launch_util.cuh"

namespace octet::ops::cuda {

/// Tensors of the tensor-core path are 16-byte aligned (cp.async moves 16 bytes).
inline constexpr uintptr_t kFastAlignment = 16;

// Simple path.
inline constexpr int kMaxHeadDim = 256;
inline constexpr int kSimpleThreads = 128;
inline constexpr int kElementwiseThreads = 256;

// ----------------------------------------------------------------------------
// Device helpers of the CUDA-core kernels (simple path, delta, RoPE)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(uint16_t x) { return fp8::decode_bf16(x); }
__device__ __forceinline__ void store_f32(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f32(uint16_t* p, float v) { *p = fp8::encode_bf16(v); }

/// Sum over the warp by xor butterfly: every lane ends with the same bits, in a fixed order.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

/// Index of the calling thread's warp in a 1-D grid.
__device__ __forceinline__ int64_t global_warp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
}

// ----------------------------------------------------------------------------
// Host helpers

/// Blocks of `threads` for `work_threads` threads in a 1-D grid.
inline unsigned int grid_for(int64_t work_threads, int threads) {
  const int64_t blocks = ceil_div(work_threads, threads);
  OCTET_CHECK(blocks <= INT32_MAX, "attention kernel over ", work_threads,
              " threads exceeds the 1-D grid limit");
  return static_cast<unsigned int>(blocks);
}

/// Whether every tensor starts kFastAlignment-aligned: what both fast paths (flash and cuDNN)
/// need of a call's tensors.
inline bool all_aligned(std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    if (reinterpret_cast<uintptr_t>(t->raw_data()) % kFastAlignment != 0) return false;
  }
  return true;
}

/// The tensor-core path applies to bf16 with head_dim 64 or 128 when every tensor is 16-byte
/// aligned (cp.async moves 16 bytes; views at odd offsets take the simple path).
inline bool use_tensor_cores(const AttentionShape& s, DType dtype,
                             std::initializer_list<const Tensor*> tensors) {
  return dtype == DType::bf16 && (s.head_dim == 64 || s.head_dim == 128) && all_aligned(tensors);
}

inline float softmax_scale(const AttentionShape& s) {
  return 1.0f / std::sqrt(static_cast<float>(s.head_dim));
}

// ----------------------------------------------------------------------------
// The paths, one file each

/// The tensor-core forward and backward (attention_flash.cu), at the library's tilings; the
/// tensors satisfy use_tensor_cores.
void attention_forward_flash(const Tensor& qkv, const AttentionShape& s, const Tensor& out,
                             const Tensor& lse, float scale, cudaStream_t stream);
void attention_backward_flash(const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                              const Tensor& delta, const AttentionShape& s, const Tensor& dqkv,
                              float scale, cudaStream_t stream);

/// The CUDA-core forward and backward (attention_simple.cu): f32 or bf16, head_dim up to
/// kMaxHeadDim, any alignment.
void attention_forward_simple(const Tensor& qkv, const AttentionShape& s, const Tensor& out,
                              const Tensor& lse, float scale, cudaStream_t stream);
void attention_backward_simple(const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                               const Tensor& delta, const AttentionShape& s, const Tensor& dqkv,
                               float scale, cudaStream_t stream);

/// delta = rowsum(dout * out) per (b, h, t), on the stream: the first kernel of every backward
/// (attention.cu).
Tensor attention_row_delta(const Tensor& dout, const Tensor& out, const AttentionShape& s,
                           cudaStream_t stream);

}  // namespace octet::ops::cuda
