// Backend entry points of the attention family (include/octet/ops/attention.h). The dispatcher in
// src/ops/attention.cc validates arguments (shapes against AttentionShape, dtypes, one device,
// even head_dim for rope), opens the device guard and NVTX range, then calls one of these;
// backends may assume valid, non-empty inputs on one device.
#pragma once

#include "octet/ops/attention.h"

namespace octet::ops::cpu {
void attention_forward(const Tensor& qkv, const AttentionShape& shape, const Tensor& out,
                       const Tensor& lse);
void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                        const AttentionShape& shape, const Tensor& dqkv);
void rope(const Tensor& qkv, const AttentionShape& shape, float theta, bool inverse);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void attention_forward(const Tensor& qkv, const AttentionShape& shape, const Tensor& out,
                       const Tensor& lse);
void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                        const AttentionShape& shape, const Tensor& dqkv);
void rope(const Tensor& qkv, const AttentionShape& shape, float theta, bool inverse);
}  // namespace octet::ops::cuda
