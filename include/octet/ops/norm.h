// LayerNorm and RMSNorm over the last dimension, forward and backward.
#pragma once

#include "octet/core/tensor.h"
#include "octet/ops/quantize.h"

namespace octet::ops {

/// y = (x - mean) * rstd * gamma + beta per row; x, y [rows, cols] f32|bf16 (same dtype); gamma,
/// beta f32 [cols]; mean, rstd f32 [rows] are written for the backward pass. Statistics in f32:
/// mean = sum(x)/cols, var = sum((x-mean)^2)/cols, rstd = 1/sqrt(var + eps). With `fused`, y's
/// FP8 copies are written too (as ops::quantize of y would), and y may be undefined: then only
/// the FP8 copies are produced (the CUDA backend then skips y's stores where it can).
void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                       const Tensor& y, const Tensor& mean, const Tensor& rstd,
                       const FusedQuantize* fused = nullptr);
/// dx (x's dtype) = LayerNorm input gradient; dgamma += sum_rows(dy * xhat), dbeta += sum_rows(dy)
/// (f32 [cols], accumulated across calls, reduced in a fixed order). With `residual` (like x):
/// dx = that gradient + residual, bitwise what a separate ops::add would give: where a residual
/// stream's two gradient paths meet, in the same pass. With accumulate_params false, dgamma and
/// dbeta are overwritten, bitwise as if they had been zeroed first (0 + the sum).
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, const Tensor& dx, const Tensor& dgamma,
                        const Tensor& dbeta, const Tensor& residual = Tensor(),
                        bool accumulate_params = true);

/// y = x * rstd * gamma, rstd = 1/sqrt(mean(x^2) + eps); `fused` and an undefined y as for
/// layernorm_forward.
void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, const Tensor& y,
                     const Tensor& rstd, const FusedQuantize* fused = nullptr);
/// dx; dgamma += sum_rows(dy * x * rstd); `residual` and accumulate_params as for
/// layernorm_backward.
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dgamma, const Tensor& residual = Tensor(),
                      bool accumulate_params = true);

}  // namespace octet::ops
