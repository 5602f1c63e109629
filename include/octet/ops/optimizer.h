// AdamW on FP32 master weights, and the global gradient norm for clipping.
#pragma once

#include "octet/core/tensor.h"
#include "octet/ops/quantize.h"

namespace octet::ops {

/// norm_sq (f32[1]) = sum over all tensors of sum(g^2), accumulated in a fixed order (per-tensor
/// partials, then tensors in the given order). The gradients may lie on several devices (a model
/// split over GPUs): each tensor's sum is taken on its own device and the sums are added on
/// norm_sq's, so the result does not depend on where the tensors are.
void global_norm_squared(const Tensor* grads, int count, const Tensor& norm_sq);

struct AdamWArgs {
  float lr = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  /// Decoupled: param -= lr * weight_decay * param. Read by the one-tensor adamw_step only; the
  /// multi-tensor step takes each tensor's own AdamWTensor::weight_decay instead.
  float weight_decay = 0.1f;
  int64_t step = 1;            ///< 1-based, for bias correction
  float max_grad_norm = 1.0f;  ///< clip threshold; <= 0 disables clipping
};

/// One AdamW step for param/grad/m/v (f32, same shape and device; norm_sq may lie on another
/// device). The gradient is scaled by min(1, max_grad_norm / (sqrt(norm_sq[0]) + 1e-6)) read
/// from the device tensor norm_sq, so clipping needs no host synchronisation.
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const Tensor& norm_sq, const AdamWArgs& args);

/// One parameter tensor of a multi-tensor AdamW step, with the state the step updates.
struct AdamWTensor {
  Tensor param, grad, m, v;   ///< f32, all of param's shape
  float weight_decay = 0.0f;  ///< this tensor's decoupled decay (0 for biases and norm gains)
  /// Optional: the updated param's FP8 cast, written by the same step, bitwise what
  /// ops::quantize(param, *cast->out, cast->args) would write after it: a 2-D param, per-tensor
  /// scaling, the copies cast->out allocated, scale_inv, and cast->args.amax raised (no column
  /// sums). The next forward's weight cast (nn::Linear::prepare_next_cast) then needs no pass
  /// over the FP32 master: on CUDA the step runs inside the cast's tile pass, which writes both
  /// copies from the updated values.
  const FusedQuantize* cast = nullptr;
  /// Optional: bf16 of param's shape on its device, set to the updated param rounded to bf16,
  /// bitwise what ops::cast(param, bf16_copy) would write after the step. A layer's bf16 weight
  /// and bias copies for its next forward (nn::Linear::prepare_next_cast) then need no cast pass
  /// and no launch per tensor.
  Tensor bf16_copy{};
};

/// The one-tensor adamw_step for every entry of `tensors` (count >= 1; each entry's tensors on
/// one device), on CUDA in one kernel launch per run of consecutive entries on one device (a
/// model split over devices: one per stage) for the entries without a cast, and in the tile
/// quantizer's launches (up to 16 casts each) for those with one, with norm_sq copied to that
/// device when it lies elsewhere. Entry i gets, bit for bit, what adamw_step would give it with
/// args.weight_decay = tensors[i].weight_decay; args.weight_decay itself is not read.
void adamw_step(const AdamWTensor* tensors, int count, const Tensor& norm_sq,
                const AdamWArgs& args);

}  // namespace octet::ops
