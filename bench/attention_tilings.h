// The tilings of the bf16 tensor-core attention kernels (src/ops/cuda/attention_flash.cuh), named
// so that one GPU run can time them side by side (attention_bench.cc). liboctet instantiates only
// the ones ops::attention_* use (default_attention_tiling, in src/ops/cuda/attention_flash.cu);
// attention_tilings.cu instantiates the others, kept for measurement. Not part of any op contract.
#pragma once

#include <cstdint>

#include "octet/ops/attention.h"

namespace octet::bench {

/// Rows each warp of the tensor-core kernels owns: queries (forward, dQ) or keys (dK/dV).
enum class AttentionTiling {
  /// One m16 row block per warp, 64-row CTAs, in every kernel: the first kernels' layout.
  /// head_dim 64 and 128.
  kRows16,
  /// Two m16 row blocks per warp sharing every fragment streamed from shared memory (half the
  /// shared-memory traffic per MMA), 128-row CTAs, in the forward and dQ kernels; dK/dV as
  /// kRows16. head_dim 64 only (register budget).
  kRows32,
  /// kRows32 in the dK/dV kernel too. Its dK, dV, S^T and dP^T tiles exceed the 255 registers
  /// by a few (ptxas spills 48 bytes), so it is offered for measurement, not used by default.
  kRows32Dkdv,
};

/// The tiling ops::attention_forward/backward use for `head_dim` (64 or 128): what
/// src/ops/cuda/attention_flash.cu instantiates.
AttentionTiling default_attention_tiling(int64_t head_dim);

/// Short name of a tiling, for benchmark names ("rows16", "rows32", "rows32_dkdv").
const char* attention_tiling_name(AttentionTiling tiling);

/// ops::cuda::attention_forward on the tensor-core path with an explicit tiling. Throws unless
/// qkv is bf16 with head_dim 64 or 128 (only kRows16 at 128) and every tensor is 16-byte aligned.
void attention_forward_tiled(const Tensor& qkv, const ops::AttentionShape& shape, const Tensor& out,
                             const Tensor& lse, AttentionTiling tiling);

/// ops::cuda::attention_backward (delta included) on the tensor-core path with an explicit
/// tiling; the same requirements as attention_forward_tiled.
void attention_backward_tiled(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, const ops::AttentionShape& shape,
                              const Tensor& dqkv, AttentionTiling tiling);

}  // namespace octet::bench
