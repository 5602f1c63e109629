// The cuDNN path of CUDA attention: cuDNN's fused SDPA through the cudnn-frontend graph API.
// attention.cu picks it (ops::attention_choice()) over the flash and simple paths. Host code;
// compiled only with the CUDA backend. Without OCTET_WITH_CUDNN_ATTENTION the cuDNN entry points
// exist but throw, and cudnn_attention_fits is always false.
#pragma once

#include <cuda_runtime.h>

#include "octet/ops/attention.h"

namespace octet::ops::cuda {

/// Whether the cuDNN path takes this call: built with it, bf16, head_dim a multiple of 8 up to
/// 128, and `aligned`: every tensor 16-byte aligned (all_aligned; cuDNN's bf16 SDPA kernels load 8
/// elements at a time; the q, k and v parts of qkv start H*D elements apart, so they stay aligned).
bool cudnn_attention_fits(const AttentionShape& s, DType dtype, bool aligned);

/// Whether cuDNN builds a plan for this call on `device`: asked once per device, shape and pass
/// (the graph is then cached for the calls, or its refusal remembered). Under auto, a refusal
/// sends the call to octet's own kernels; under cudnn, the call throws with cuDNN's reason.
bool cudnn_attention_builds(const Device& device, const AttentionShape& s, bool backward,
                            float scale);

/// Forward through cuDNN: out and lse (cuDNN's Stats, natural-log LSE of the scaled scores) of
/// qkv, reading q, k and v in place through strides. The tensors satisfy cudnn_attention_fits.
void attention_forward_cudnn(const Tensor& qkv, const AttentionShape& s, const Tensor& out,
                             const Tensor& lse, float scale, cudaStream_t stream);
/// Backward through cuDNN's deterministic SDPA backward, writing dq, dk and dv into dqkv in place.
void attention_backward_cudnn(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, const AttentionShape& s, const Tensor& dqkv,
                              float scale, cudaStream_t stream);

}  // namespace octet::ops::cuda
