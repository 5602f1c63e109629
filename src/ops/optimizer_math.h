// The scalar AdamW step and its clip factor, written once for the CPU reference and the CUDA kernel
// so both backends agree bit for bit.
//
// Why this is bit-exact across compilers: every product that feeds an addition is an explicit
// fused multiply-add (fma_rn: __fmaf_rn on the GPU, std::fma on the host, both the correctly
// rounded IEEE operation), and every other operation is a single IEEE-rounded f32 add, multiply,
// divide or square root (the __f*_rn intrinsics on the GPU, which nvcc never contracts). No
// product is left for a compiler to contract on its own (nvcc contracts a*b+c by default, and GCC
// does too for C++ on targets with FMA), so there is exactly one result on every backend.
#pragma once

#include <cmath>
#include <cstdint>

#include "octet/fp8/format.h"  // OCTET_HD
#include "octet/ops/optimizer.h"

namespace octet::ops {

/// Added to the gradient norm before dividing by it (the contract in octet/ops/optimizer.h).
inline constexpr float kClipEpsilon = 1e-6f;

/// AdamWArgs resolved on the host into the f32 constants the step shares across tensors (the
/// weight decay is per tensor, so it travels with each tensor instead).
struct AdamWCoefficients {
  float lr;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float bias_correction1;  ///< 1 - beta1^step, computed in double, rounded once
  float bias_correction2;  ///< 1 - beta2^step, computed in double, rounded once
  float max_grad_norm;
};

/// Resolves `args` (already validated: step >= 1, betas in [0, 1)).
inline AdamWCoefficients adamw_coefficients(const AdamWArgs& args) {
  const double step = static_cast<double>(args.step);
  AdamWCoefficients c;
  c.lr = args.lr;
  c.beta1 = args.beta1;
  c.one_minus_beta1 = 1.0f - args.beta1;
  c.beta2 = args.beta2;
  c.one_minus_beta2 = 1.0f - args.beta2;
  c.eps = args.eps;
  c.bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(args.beta1), step));
  c.bias_correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(args.beta2), step));
  c.max_grad_norm = args.max_grad_norm;
  return c;
}

namespace rn {
// Single correctly rounded f32 operations that no compiler fuses with a neighbour.
#if defined(__CUDA_ARCH__)
OCTET_HD float add(float a, float b) { return __fadd_rn(a, b); }
OCTET_HD float mul(float a, float b) { return __fmul_rn(a, b); }
OCTET_HD float div(float a, float b) { return __fdiv_rn(a, b); }
OCTET_HD float sqrt(float a) { return __fsqrt_rn(a); }
OCTET_HD float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#else
// On the host a lone add, multiply, divide or sqrt is already one IEEE operation; contraction
// could only pair a multiply with an add, and the step below leaves no such pair.
inline float add(float a, float b) { return a + b; }
inline float mul(float a, float b) { return a * b; }
inline float div(float a, float b) { return a / b; }
inline float sqrt(float a) { return std::sqrt(a); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
#endif
}  // namespace rn

/// The gradient multiplier: min(1, max_grad_norm / (sqrt(norm_sq) + 1e-6)), or 1 when clipping is
/// off (max_grad_norm <= 0). A NaN norm gives 1 (the NaN gradients then reach the weights, where
/// the trainer's finiteness check sees them).
OCTET_HD float adamw_clip_factor(float norm_sq, float max_grad_norm) {
  if (!(max_grad_norm > 0.0f)) return 1.0f;
  const float ratio = rn::div(max_grad_norm, rn::add(rn::sqrt(norm_sq), kClipEpsilon));
  return ratio < 1.0f ? ratio : 1.0f;
}

/// One element of the AdamW step, in this exact order of f32 operations:
///   g     = grad * clip
///   m     = fma(beta1, m, (1 - beta1) * g)
///   v     = fma(beta2, v, ((1 - beta2) * g) * g)
///   u     = (m / bc1) / (sqrt(v / bc2) + eps)
///   param = fma(-lr, fma(weight_decay, param, u), param)
/// i.e. param -= lr * (mhat / (sqrt(vhat) + eps) + weight_decay * param) with the decay read from
/// the weight before the update.
OCTET_HD void adamw_update(float& param, float grad, float& m, float& v, const AdamWCoefficients& c,
                           float weight_decay, float clip) {
  const float g = rn::mul(grad, clip);
  m = rn::fma(c.beta1, m, rn::mul(c.one_minus_beta1, g));
  v = rn::fma(c.beta2, v, rn::mul(rn::mul(c.one_minus_beta2, g), g));
  const float m_hat = rn::div(m, c.bias_correction1);
  const float v_hat = rn::div(v, c.bias_correction2);
  const float update = rn::div(m_hat, rn::add(rn::sqrt(v_hat), c.eps));
  param = rn::fma(-c.lr, rn::fma(weight_decay, param, update), param);
}

}  // namespace octet::ops
