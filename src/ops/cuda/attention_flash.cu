// The tensor-core attention path (attention_flash.cuh's kernels) at each AttentionTiling, and
// the tiled entry points of attention_tiling.h that the benchmark compares them with.
#include <cuda_runtime.h>

#include <initializer_list>

#include "octet/core/cuda_context.h"
#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/attention_flash.cuh"
#include "ops/cuda/attention_tiling.h"

namespace octet::ops::cuda {
namespace {

/// The tensor-core forward with `tiling` (head_dim 64 or 128; only kRows16 at 128).
void forward_tiled(const Tensor& qkv, const AttentionShape& s, const Tensor& out, const Tensor& lse,
                   AttentionTiling tiling, float scale, cudaStream_t stream) {
  if (s.head_dim == 128) {
    forward_tensor_cores<128, 1>(qkv, s, out, lse, scale, stream);
  } else if (tiling == AttentionTiling::kRows16) {
    forward_tensor_cores<64, 1>(qkv, s, out, lse, scale, stream);
  } else {
    forward_tensor_cores<64, 2>(qkv, s, out, lse, scale, stream);
  }
}

/// The tensor-core dK/dV and dQ kernels with `tiling` (as forward_tiled).
void backward_tiled(const Tensor& dout, const Tensor& qkv, const Tensor& lse, const Tensor& delta,
                    const AttentionShape& s, const Tensor& dqkv, AttentionTiling tiling,
                    float scale, cudaStream_t stream) {
  if (s.head_dim == 128) {
    backward_tensor_cores<128, 1, 1>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  } else if (tiling == AttentionTiling::kRows16) {
    backward_tensor_cores<64, 1, 1>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  } else if (tiling == AttentionTiling::kRows32) {
    backward_tensor_cores<64, 1, 2>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  } else {
    backward_tensor_cores<64, 2, 2>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  }
}

/// Checks that the tensor-core path with `tiling` applies (attention_*_tiled's contract).
void check_tiled(const AttentionShape& s, DType dtype, std::initializer_list<const Tensor*> tensors,
                 AttentionTiling tiling, const char* op) {
  OCTET_CHECK(use_tensor_cores(s, dtype, tensors), op,
              ": the tensor-core path needs bf16, head_dim 64 or 128 and 16-byte aligned tensors; "
              "got ",
              dtype_name(dtype), " and head_dim ", s.head_dim);
  OCTET_CHECK(tiling == AttentionTiling::kRows16 || s.head_dim == 64, op, ": tiling ",
              attention_tiling_name(tiling), " supports head_dim 64 only, got ", s.head_dim);
}

}  // namespace

AttentionTiling default_attention_tiling(int64_t head_dim) {
  // Two row blocks per warp halve the shared-memory traffic per MMA (FastTiles); at head_dim
  // 128 their accumulators do not fit in registers.
  return head_dim == 64 ? AttentionTiling::kRows32 : AttentionTiling::kRows16;
}

const char* attention_tiling_name(AttentionTiling tiling) {
  switch (tiling) {
    case AttentionTiling::kRows16:
      return "rows16";
    case AttentionTiling::kRows32:
      return "rows32";
    case AttentionTiling::kRows32Dkdv:
      return "rows32_dkdv";
  }
  return "unknown";
}

void attention_forward_tiled(const Tensor& qkv, const AttentionShape& shape, const Tensor& out,
                             const Tensor& lse, AttentionTiling tiling) {
  check_tiled(shape, qkv.dtype(), {&qkv, &out}, tiling, "attention_forward_tiled");
  const Device device = qkv.device();
  DeviceGuard guard(device);
  forward_tiled(qkv, shape, out, lse, tiling, softmax_scale(shape), octet::cuda::stream(device));
}

void attention_backward_tiled(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, const AttentionShape& shape, const Tensor& dqkv,
                              AttentionTiling tiling) {
  check_tiled(shape, qkv.dtype(), {&qkv, &dout, &dqkv}, tiling, "attention_backward_tiled");
  const Device device = qkv.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const Tensor delta = attention_row_delta(dout, out, shape, stream);
  backward_tiled(dout, qkv, lse, delta, shape, dqkv, tiling, softmax_scale(shape), stream);
}

void attention_forward_flash(const Tensor& qkv, const AttentionShape& s, const Tensor& out,
                             const Tensor& lse, float scale, cudaStream_t stream) {
  forward_tiled(qkv, s, out, lse, default_attention_tiling(s.head_dim), scale, stream);
}

void attention_backward_flash(const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                              const Tensor& delta, const AttentionShape& s, const Tensor& dqkv,
                              float scale, cudaStream_t stream) {
  backward_tiled(dout, qkv, lse, delta, s, dqkv, default_attention_tiling(s.head_dim), scale,
                 stream);
}

}  // namespace octet::ops::cuda
