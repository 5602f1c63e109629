// Backend entry points of the MoE family (include/octet/ops/moe.h). The dispatcher (src/ops/moe.cc)
// validates every argument and opens the device guard and NVTX range; backends may assume valid,
// non-empty inputs on one device, a plan that moe_plan filled, and (for the CPU) every expert
// index in range. Undefined optional tensors are passed as undefined Tensors.
#pragma once

#include "octet/ops/moe.h"

namespace octet::ops::cpu {
void router_logits(const Tensor& x, const Tensor& weight, const Tensor& logits);
void router_logits_backward(const Tensor& x, const Tensor& weight, const Tensor& dlogits,
                            const Tensor& dx, const Tensor& dweight, bool accumulate);
void router_forward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& out);
void router_backward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& saved,
                     const Tensor& dprob, const Tensor& dlogits);
void moe_plan(const Tensor& expert, const MoePlan& plan);
void moe_dispatch(const Tensor& x, const MoePlan& plan, const Tensor& permuted);
void moe_dispatch_backward(const Tensor& d_permuted, const MoePlan& plan, const Tensor& dx);
void moe_combine(const Tensor& expert_out, const Tensor& prob, const MoePlan& plan,
                 const Tensor& y);
void moe_combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& prob,
                          const MoePlan& plan, const Tensor& d_expert_out, const Tensor& dprob);
void moe_gather_row_probs(const Tensor& prob, const MoePlan& plan, const Tensor& row_prob);
void moe_scatter_row_probs(const Tensor& d_row_prob, const MoePlan& plan, const Tensor& dprob);
void moe_scaled_activation_forward(MoeActivation act, const Tensor& fc1, const Tensor& row_prob,
                                   const MoePlan& plan, const Tensor& bias, const Tensor& h);
void moe_scaled_activation_backward(MoeActivation act, const Tensor& dh, const Tensor& fc1,
                                    const Tensor& row_prob, const MoePlan& plan,
                                    const Tensor& bias, const Tensor& dfc1,
                                    const Tensor& d_row_prob, const Tensor& dbias);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void router_logits(const Tensor& x, const Tensor& weight, const Tensor& logits);
void router_logits_backward(const Tensor& x, const Tensor& weight, const Tensor& dlogits,
                            const Tensor& dx, const Tensor& dweight, bool accumulate);
void router_forward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& out);
void router_backward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& saved,
                     const Tensor& dprob, const Tensor& dlogits);
void moe_plan(const Tensor& expert, const MoePlan& plan);
void moe_dispatch(const Tensor& x, const MoePlan& plan, const Tensor& permuted);
void moe_dispatch_backward(const Tensor& d_permuted, const MoePlan& plan, const Tensor& dx);
void moe_combine(const Tensor& expert_out, const Tensor& prob, const MoePlan& plan,
                 const Tensor& y);
void moe_combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& prob,
                          const MoePlan& plan, const Tensor& d_expert_out, const Tensor& dprob);
void moe_gather_row_probs(const Tensor& prob, const MoePlan& plan, const Tensor& row_prob);
void moe_scatter_row_probs(const Tensor& d_row_prob, const MoePlan& plan, const Tensor& dprob);
void moe_scaled_activation_forward(MoeActivation act, const Tensor& fc1, const Tensor& row_prob,
                                   const MoePlan& plan, const Tensor& bias, const Tensor& h);
/// The scaled activation computed into the tile quantizer, each expert a matrix over its rows of
/// fc1 (so fc1 is read once) and the experts' tiles in shared launches
/// (quant::quantize_tile_group), each tile writing its expert's FP8 copies, scales and amax; h
/// (optional) is stored from the same values, its tail past the groups zeroed.
void moe_scaled_activation_forward_cast(MoeActivation act, const Tensor& fc1,
                                        const Tensor& row_prob, const MoePlan& plan,
                                        const Tensor& bias, const Tensor& h,
                                        const MoeExpertCasts& casts);
void moe_scaled_activation_backward(MoeActivation act, const Tensor& dh, const Tensor& fc1,
                                    const Tensor& row_prob, const MoePlan& plan,
                                    const Tensor& bias, const Tensor& dfc1,
                                    const Tensor& d_row_prob, const Tensor& dbias);
}  // namespace octet::ops::cuda
