// Causal self-attention (BF16/F32) on a packed QKV tensor, and rotary position embeddings.
#pragma once

#include "octet/core/tensor.h"

namespace octet::ops {

struct AttentionShape {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
};

/// qkv: [batch*seq, 3*heads*head_dim] laid out [q | k | v], each [heads, head_dim] per token.
/// out: [batch*seq, heads*head_dim] (qkv's dtype); lse: f32 [batch, heads, seq] log-sum-exp of
/// the scaled scores per query, saved for backward. Causal mask, softmax scale 1/sqrt(head_dim).
void attention_forward(const Tensor& qkv, const AttentionShape& shape, const Tensor& out,
                       const Tensor& lse);
/// dqkv (qkv's shape and dtype) from dout, with the forward's qkv, out and lse.
/// Deterministic: no float atomics.
void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& lse, const AttentionShape& shape, const Tensor& dqkv);

/// Rotary embeddings applied in place to the q and k parts of qkv (pairs (2i, 2i+1) of each head
/// rotated by pos * theta^(-2i/head_dim), pos = token index within its sequence). inverse=true
/// applies the opposite rotation (the backward pass of rope on dqkv).
void rope(const Tensor& qkv, const AttentionShape& shape, float theta, bool inverse);

}  // namespace octet::ops
