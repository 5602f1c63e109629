// Causal self-attention (BF16/F32) on a packed QKV tensor, and rotary position embeddings.
#pragma once

#include <string_view>

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

/// Which implementation CUDA attention is asked to run: env OCTET_ATTENTION ("flash"; "cudnn";
/// "auto", the default), or set_attention_choice. cudnn and auto both run cuDNN's fused SDPA
/// where the call fits it (see AttentionPath). cudnn needs a build with it, and a shape cuDNN
/// builds no plan for is an error; auto runs octet's own kernels in both cases. auto is the
/// default because cuDNN's kernels are the faster ones on Hopper; both paths are deterministic.
enum class AttentionChoice { flash, cudnn, automatic };
/// The implementation a CUDA attention call runs: the tensor-core kernels (bf16, head_dim 64 or
/// 128), cuDNN's SDPA (bf16, head_dim a multiple of 8 up to 128), or the CUDA-core kernels that
/// take everything else (f32, other head_dims, unaligned views). All are deterministic.
enum class AttentionPath { flash, cudnn, simple };

/// "flash", "cudnn" or "auto" (OCTET_ATTENTION's and `octet train --attention`'s spelling);
/// throws on anything else, listing the valid values, and on "cudnn" when
/// cudnn_attention_built() is false. `source` (where the text came from) begins the messages.
AttentionChoice parse_attention_choice(std::string_view text,
                                       std::string_view source = "OCTET_ATTENTION");
/// The inverse: "flash", "cudnn" or "auto".
const char* attention_choice_name(AttentionChoice choice);
/// The last set_attention_choice, else OCTET_ATTENTION (read once per process), else auto.
AttentionChoice attention_choice();
/// Overrides OCTET_ATTENTION for this process; throws for cudnn when it is not built.
void set_attention_choice(AttentionChoice choice);
/// Sets the choice for one scope (a test, a benchmark), then restores the one before.
class ScopedAttentionChoice {
 public:
  explicit ScopedAttentionChoice(AttentionChoice choice) : previous_(attention_choice()) {
    set_attention_choice(choice);
  }
  ~ScopedAttentionChoice() { set_attention_choice(previous_); }
  ScopedAttentionChoice(const ScopedAttentionChoice&) = delete;
  ScopedAttentionChoice& operator=(const ScopedAttentionChoice&) = delete;

 private:
  AttentionChoice previous_;
};
/// Whether this build has the cuDNN path (CMake option OCTET_WITH_CUDNN_ATTENTION).
bool cudnn_attention_built();
/// The path attention_forward runs on qkv's CUDA device for `shape` under the current choice,
/// when its other tensors are 16-byte aligned as octet allocates them (under auto this builds, or
/// finds cached, cuDNN's forward plan for the shape).
AttentionPath attention_path(const Tensor& qkv, const AttentionShape& shape);
/// "flash", "cudnn" or "simple".
const char* attention_path_name(AttentionPath path);

/// Rotary embeddings applied in place to the q and k parts of qkv (pairs (2i, 2i+1) of each head
/// rotated by pos * theta^(-2i/head_dim), pos = token index within its sequence). inverse=true
/// applies the opposite rotation (the backward pass of rope on dqkv).
void rope(const Tensor& qkv, const AttentionShape& shape, float theta, bool inverse);

}  // namespace octet::ops
