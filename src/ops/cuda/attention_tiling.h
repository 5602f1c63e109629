// Internal to the CUDA attention backend and its benchmark (bench/attention_bench.cc): the tilings
// of the bf16 tensor-core kernels, so that one GPU run can time them side by side. Not part of the
// op contract; ops::attention_* always use default_attention_tiling.
#pragma once

#include <cstdint>

#include "octet/ops/attention.h"

namespace octet::ops::cuda {

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

/// The tiling ops::attention_forward/backward use for `head_dim` (64 or 128).
AttentionTiling default_attention_tiling(int64_t head_dim);

/// Short name of a tiling, for benchmark names ("rows16", "rows32", "rows32_dkdv").
const char* attention_tiling_name(AttentionTiling tiling);

/// ops::cuda::attention_forward on the tensor-core path with an explicit tiling. Throws unless
/// qkv is bf16 with head_dim 64 or 128 (only kRows16 at 128) and every tensor is 16-byte aligned.
void attention_forward_tiled(const Tensor& qkv, const AttentionShape& shape, const Tensor& out,
                             const Tensor& lse, AttentionTiling tiling);

/// ops::cuda::attention_backward (delta included) on the tensor-core path with an explicit
/// tiling; the same requirements as attention_forward_tiled.
void attention_backward_tiled(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, const AttentionShape& shape, const Tensor& dqkv,
                              AttentionTiling tiling);

}  // namespace octet::ops::cuda
