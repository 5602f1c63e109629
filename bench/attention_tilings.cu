// The tilings of the tensor-core attention kernels that ops::attention_* do not use, kept to
// measure against the ones they do (attention_bench.cc, which also checks their results against
// the library's): rows16 at head_dim 64 (one m16 row block per warp in every kernel) and
// rows32_dkdv (two in the dK/dV kernel too). Measurement only; never part of liboctet. The
// kernels are liboctet's own (src/ops/cuda/attention_flash.cuh), instantiated here at these
// tilings; at the library's tilings the calls go to the library.
#include "attention_tilings.h"

#include <cuda_runtime.h>

#include <initializer_list>

#include "octet/core/cuda_context.h"
#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/attention_flash.cuh"

namespace octet::bench {
namespace {

using ops::AttentionShape;

/// Checks that the tensor-core path with `tiling` applies (attention_*_tiled's contract).
void check_tiled(const AttentionShape& s, DType dtype, std::initializer_list<const Tensor*> tensors,
                 AttentionTiling tiling, const char* op) {
  OCTET_CHECK(ops::cuda::use_tensor_cores(s, dtype, tensors), op,
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
  cudaStream_t stream = octet::cuda::stream(device);
  const float scale = ops::cuda::softmax_scale(shape);
  if (shape.head_dim == 64 && tiling == AttentionTiling::kRows16) {
    ops::cuda::forward_tensor_cores<64, 1>(qkv, shape, out, lse, scale, stream);
  } else {  // the library's tiling; rows32_dkdv differs from rows32 in the dK/dV kernel only
    ops::cuda::attention_forward_flash(qkv, shape, out, lse, scale, stream);
  }
}

void attention_backward_tiled(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, const AttentionShape& shape, const Tensor& dqkv,
                              AttentionTiling tiling) {
  check_tiled(shape, qkv.dtype(), {&qkv, &dout, &dqkv}, tiling, "attention_backward_tiled");
  const Device device = qkv.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const float scale = ops::cuda::softmax_scale(shape);
  const Tensor delta = ops::cuda::attention_row_delta(dout, out, shape, stream);
  if (tiling == default_attention_tiling(shape.head_dim)) {
    ops::cuda::attention_backward_flash(dout, qkv, lse, delta, shape, dqkv, scale, stream);
  } else if (tiling == AttentionTiling::kRows16) {  // head_dim 64 (check_tiled)
    ops::cuda::backward_tensor_cores<64, 1, 1>(dout, qkv, lse, delta, shape, dqkv, scale, stream);
  } else {  // kRows32Dkdv
    ops::cuda::backward_tensor_cores<64, 2, 2>(dout, qkv, lse, delta, shape, dqkv, scale, stream);
  }
}

}  // namespace octet::bench
