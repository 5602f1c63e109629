// Token (+ learned position) embeddings and the fused softmax + cross-entropy loss.
#pragma once

#include "octet/core/tensor.h"

namespace octet::ops {

/// out[b*seq + t] = wte[ids[b*seq + t]] (+ wpe[t] when wpe is defined). ids i32 [batch*seq];
/// wte [vocab, dim], wpe [max_seq, dim] f32; out [batch*seq, dim] f32|bf16. Throws on an id
/// outside [0, vocab) (CPU) / records it for a checked error (CUDA).
void embedding_forward(const Tensor& ids, const Tensor& wte, const Tensor& wpe, int64_t seq,
                       const Tensor& out);
/// dwte[v] += sum of dout rows whose id is v; dwpe[t] += sum over the batch of dout rows at t.
/// f32 accumulators, summed in increasing row order (deterministic, no float atomics).
void embedding_backward(const Tensor& ids, const Tensor& dout, int64_t seq, const Tensor& dwte,
                        const Tensor& dwpe);

/// Fused softmax + cross-entropy over the vocabulary. logits [rows, vocab] f32|bf16, targets i32
/// [rows] (a negative target ignores the row: loss 0, gradient 0). losses f32 [rows] =
/// logsumexp(logits) - logits[target]. When dlogits is defined, writes (softmax - onehot) *
/// grad_scale (logits' dtype), e.g. grad_scale = 1 / (rows * accumulation steps).
void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                   const Tensor& dlogits, float grad_scale);

}  // namespace octet::ops
