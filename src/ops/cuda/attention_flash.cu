// The tensor-core attention path: attention_flash.cuh's kernels at the tilings ops::attention_*
// use. The other tilings (bench/attention_tilings.h names them all) are kept for measurement
// only, outside liboctet: bench/attention_tilings.cu instantiates them, checks them against
// these and times them side by side (octet_bench's attention/* benchmarks).
#include <cuda_runtime.h>

#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/attention_flash.cuh"

namespace octet::ops::cuda {

// Two m16 row blocks per warp (kM = 2) halve the shared-memory traffic per MMA (FastTiles); at
// head_dim 128 their accumulators do not fit in registers, and in the dK/dV kernel they spill
// (48 bytes), so that kernel keeps one: the tiling rows32 at head_dim 64, rows16 at 128.

void attention_forward_flash(const Tensor& qkv, const AttentionShape& s, const Tensor& out,
                             const Tensor& lse, float scale, cudaStream_t stream) {
  if (s.head_dim == 128) {
    forward_tensor_cores<128, 1>(qkv, s, out, lse, scale, stream);
  } else {
    forward_tensor_cores<64, 2>(qkv, s, out, lse, scale, stream);
  }
}

void attention_backward_flash(const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                              const Tensor& delta, const AttentionShape& s, const Tensor& dqkv,
                              float scale, cudaStream_t stream) {
  if (s.head_dim == 128) {
    backward_tensor_cores<128, 1, 1>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  } else {
    backward_tensor_cores<64, 1, 2>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  }
}

}  // namespace octet::ops::cuda
