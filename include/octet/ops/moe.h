// The ops of a mixture-of-experts layer besides the experts' GEMMs: the router (its logits, top-k
// over softmax or sigmoid scores, load-balancing aux loss, z-loss), the plan that lays routed rows
// out expert by expert, dispatch and combine, and the prob-scaled expert activation. Every op has
// one path, deterministic by construction: each reduction runs in one fixed order, with no float
// atomics (docs/DETERMINISM.md).
//
// A layer runs, per step:
//   router_logits(x) -> logits;
//   router_forward(logits) -> expert, prob, counts;  moe_plan(expert) -> offsets, row maps;
//   moe_dispatch(x) -> permuted rows;  FC1 (grouped GEMM);  moe_gather_row_probs(prob);
//   moe_scaled_activation_forward(fc1, row_prob) -> h (or FC2's FP8 input, per expert);  FC2;
//   moe_combine(expert_out) -> y   (prob undefined there: it was applied in the activation)
// and the backward ops in reverse order.
#pragma once

#include <cstdint>
#include <span>

#include "octet/core/tensor.h"
#include "octet/ops/quantize.h"

namespace octet::ops {

/// Rows of every expert group in the permuted layout are padded to a multiple of this. FP8 GEMMs
/// need 16 (cuBLASLt's leading dimensions are multiples of 16 bytes); 128 is the row tile of
/// Hopper's GEMM kernels, so a partial tile costs what a full one does anyway, and rows per expert
/// then take few distinct values: the per-expert GEMMs reuse their cuBLASLt plans step after
/// step instead of planning each new row count on the host.
inline constexpr int64_t kMoeGroupAlign = 128;
/// The per-expert bias gradient sums partials of this many rows (groups hold whole tiles).
inline constexpr int64_t kMoeBiasTileRows = 16;
static_assert(kMoeGroupAlign % kMoeBiasTileRows == 0);

/// How the router turns logits into scores.
enum class RouterScoring : uint8_t {
  softmax,  ///< Mixtral: softmax over experts, top-k, then the k probabilities renormalised
  sigmoid,  ///< DeepSeek-V3: sigmoid per expert, top-k of score + selection_bias, the k unbiased
            ///< scores renormalised
};

/// "softmax" or "sigmoid".
const char* router_scoring_name(RouterScoring scoring);

/// Router settings. The aux and z losses are on when their coefficient is > 0.
struct RouterArgs {
  RouterScoring scoring = RouterScoring::softmax;
  int64_t topk = 2;
  /// Optional f32 [experts] (sigmoid only): added to the scores for selection only (aux-loss-free
  /// balancing); the gate values stay the unbiased scores.
  Tensor selection_bias;
  /// aux = coef * E * sum_e f_e * P_e; f_e = counts[e] / (tokens * topk) (not differentiated),
  /// P_e = mean over tokens of scores[t, e] (the softmax probability, or the sigmoid score).
  float aux_loss_coef = 0.0f;
  /// z = coef * mean over tokens of logsumexp(logits[t, :])^2.
  float z_loss_coef = 0.0f;
};

/// What router_forward writes (the caller allocates; allocate() gives the shapes) and
/// router_backward reads back.
struct RouterOutputs {
  Tensor expert;    ///< i32 [tokens, topk]: chosen experts, best first; ties: lower index first
  Tensor prob;      ///< f32 [tokens, topk]: gate values, renormalised over the k
  Tensor counts;    ///< i32 [experts]: routed slots per expert
  Tensor scores;    ///< f32 [tokens, experts]: softmax probabilities or sigmoid scores
  Tensor lse;       ///< f32 [tokens]: logsumexp of each logits row (the z-loss's)
  Tensor aux_loss;  ///< f32 [1]: the load-balancing loss (0 when off)
  Tensor z_loss;    ///< f32 [1]: the z-loss (0 when off)

  static RouterOutputs allocate(int64_t tokens, int64_t experts, int64_t topk,
                                const Device& device);
};

/// Scores, top-k and gate values of f32 logits [tokens, experts]; the counts, and the aux and z
/// losses, reduced on the device in a fixed order. Per token everything runs serially over the
/// experts (one thread per token on CUDA), so the choice of experts matches the CPU exactly
/// whenever the scores do (softmax selects on the logits themselves: always exact).
void router_forward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& out);

/// dlogits (f32 [tokens, experts], overwritten) = d(L)/d(logits) where dprob (f32 [tokens, topk])
/// is dL/dprob and L also holds aux_loss + z_loss (each with gradient 1; their coefficients are
/// inside them). `saved` is router_forward's output for these logits.
void router_backward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& saved,
                     const Tensor& dprob, const Tensor& dlogits);

/// Tokens of one partial sum of router_logits_backward's weight gradient.
inline constexpr int64_t kRouterTileTokens = 256;

/// The router's GEMM, reading x in its own dtype (no f32 copy of the activations):
///   logits[t, e] = sum over k = 0..dim-1, in that order, of x[t, k] * weight[e, k], each term
///   fused into the running sum from +0 (fma), so every backend gives the same bits.
/// x f32|bf16 [tokens, dim]; weight f32 [experts, dim]; logits f32 [tokens, experts].
void router_logits(const Tensor& x, const Tensor& weight, const Tensor& logits);

/// The gradients of router_logits, given dlogits f32 [tokens, experts]:
///   dx[t, k] = dx[t, k] + sum over e = 0..experts-1, in that order, of dlogits[t, e] *
///     weight[e, k] (fma from +0; the sum added to dx in f32, rounded once to dx's dtype): added
///     into dx (x's shape and dtype), which holds the layer's other gradient of x;
///   dweight[e, k] (f32 [experts, dim]) = sum over the kRouterTileTokens-token tiles, in order, of
///     each tile's sum over its tokens, in order, of dlogits[t, e] * x[t, k] (fma from +0);
///     added to dweight when `accumulate`, else written.
void router_logits_backward(const Tensor& x, const Tensor& weight, const Tensor& dlogits,
                            const Tensor& dx, const Tensor& dweight, bool accumulate);

/// Rows of the permuted buffers for `tokens` x `topk` routed slots over `experts` groups, each
/// padded to kMoeGroupAlign: an upper bound that needs no host read-back of the counts. Rows past
/// offsets[experts] are padding too.
int64_t moe_capacity(int64_t tokens, int64_t topk, int64_t experts);

/// The expert-contiguous layout of the routed slots. Within an expert the rows follow token order,
/// then slot order (a stable sort).
struct MoePlan {
  Tensor offsets;   ///< i32 [experts + 1]: expert e owns rows [offsets[e], offsets[e+1]); each
                    ///< group padded to kMoeGroupAlign (the host reads it once per layer for the
                    ///< per-expert GEMMs)
  Tensor row_map;   ///< i32 [capacity, 2]: (token, slot) of each permuted row; (-1, -1) = padding
  Tensor slot_row;  ///< i32 [tokens, topk]: the permuted row of each (token, slot)

  int64_t experts() const { return offsets.numel() - 1; }
  int64_t capacity() const { return row_map.size(0); }
  static MoePlan allocate(int64_t tokens, int64_t topk, int64_t experts, const Device& device);
};

/// Fills `plan` from expert (i32 [tokens, topk], every value in [0, experts)). Integer work only:
/// exact on every backend.
void moe_plan(const Tensor& expert, const MoePlan& plan);

/// permuted[r] = x[token of r] (f32|bf16 [capacity, dim], x's dtype), zero for padding rows.
void moe_dispatch(const Tensor& x, const MoePlan& plan, const Tensor& permuted);
/// dx[t] = sum over slots s = 0..topk-1, in that order, of d_permuted[slot_row[t, s]] (f32 sums,
/// rounded once to dx's dtype): the gradient of moe_dispatch.
void moe_dispatch_backward(const Tensor& d_permuted, const MoePlan& plan, const Tensor& dx);

/// y[t] = sum over s = 0..topk-1, in that order, of prob[t, s] * expert_out[slot_row[t, s]] (f32,
/// each product rounded before its add, rounded once to y's dtype). prob may be undefined: weight
/// 1 (the prob was applied earlier, by moe_scaled_activation_forward).
void moe_combine(const Tensor& expert_out, const Tensor& prob, const MoePlan& plan, const Tensor& y);
/// The gradient of moe_combine: d_expert_out[slot_row[t, s]] = prob[t, s] * dy[t] (padding rows
/// 0), and, when prob is defined, dprob[t, s] = <dy[t], expert_out[slot_row[t, s]]>, one dot per
/// slot in fixed_order_reduce.h's order over kMoeDotLanes lanes.
void moe_combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& prob,
                          const MoePlan& plan, const Tensor& d_expert_out, const Tensor& dprob);

/// Lanes of the fixed reduction order of every per-row dot product of this family (one CTA of
/// this many threads per row on CUDA; the CPU reproduces the same order).
inline constexpr int kMoeDotLanes = 256;

/// row_prob[r] = prob[row_map[r]] (f32 [capacity]; 0 for padding rows).
void moe_gather_row_probs(const Tensor& prob, const MoePlan& plan, const Tensor& row_prob);
/// dprob[t, s] = d_row_prob[slot_row[t, s]]: the gradient of moe_gather_row_probs (a permutation:
/// nothing is summed).
void moe_scatter_row_probs(const Tensor& d_row_prob, const MoePlan& plan, const Tensor& dprob);

/// The expert MLP's activation.
enum class MoeActivation : uint8_t {
  swiglu,  ///< fc1 [rows, 2F] = [gate | up]: silu(gate) * up
  geglu,   ///< fc1 [rows, 2F] = [gate | up]: gelu(gate) * up (tanh GELU)
  srelu,   ///< max(x, 0)^2
  gelu,    ///< tanh GELU
};

/// "swiglu", "geglu", "srelu" or "gelu".
const char* moe_activation_name(MoeActivation act);
/// Columns of fc1 for F activation outputs (2F for the gated ones).
int64_t moe_activation_input_cols(MoeActivation act, int64_t f);

/// FC2's FP8 input, one target per expert (each expert has its own scale and amax): expert e's
/// rows [offsets[e], offsets[e+1]) of h go to experts[e], bitwise as
/// ops::quantize(h.slice(offsets[e], offsets[e+1]), *experts[e].out, experts[e].args) would.
/// The targets are what GroupedLinear::fused_input gives; column sums are not supported.
struct MoeExpertCasts {
  /// plan.offsets on the host (experts + 1 entries), which the caller has read for the GEMMs.
  std::span<const int64_t> offsets;
  /// One per expert; out == nullptr is allowed (and ignored) only for experts without rows.
  std::span<const FusedQuantize> experts;
};

/// h[r, j] = (act(fc1)[r, j] + bias[e(r), j]) * row_prob[r] for the rows of expert e(r); 0 for
/// padding rows. fc1 [capacity, in_cols] and h [capacity, F] f32|bf16 (same dtype); row_prob f32
/// [capacity]; bias optional f32 [experts, F] (the per-expert bias on the activation's output,
/// the "scale_bias" form of docs/DETERMINISM.md). With `casts`, FC2's FP8 input is written too,
/// every expert's rows with that expert's scale, in the same pass over fc1 on CUDA (h may then be
/// undefined: it is not stored).
void moe_scaled_activation_forward(MoeActivation act, const Tensor& fc1, const Tensor& row_prob,
                                   const MoePlan& plan, const Tensor& bias, const Tensor& h,
                                   const MoeExpertCasts* casts = nullptr);

/// The gradient of moe_scaled_activation_forward, given dh [capacity, F]:
///   dfc1 = act'(fc1) * (dh * row_prob) (fc1's shape and dtype; padding rows 0);
///   d_row_prob[r] = sum_j dh[r, j] * (act(fc1)[r, j] + bias[e(r), j]) (f32 [capacity]), one row
///     per CTA in fixed_order_reduce.h's order over kMoeDotLanes lanes;
///   dbias[e, j] (f32 [experts, F], overwritten; only with bias) = sum over the rows of e of
///     dh[r, j] * row_prob[r]: per kMoeBiasTileRows-row tile in row order, then the tiles of e in
///     order (groups are padded to whole tiles, so no tile spans two experts).
void moe_scaled_activation_backward(MoeActivation act, const Tensor& dh, const Tensor& fc1,
                                    const Tensor& row_prob, const MoePlan& plan,
                                    const Tensor& bias, const Tensor& dfc1,
                                    const Tensor& d_row_prob, const Tensor& dbias);

}  // namespace octet::ops
