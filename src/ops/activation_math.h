// Scalar formulas of the norms and the MLP activations, written once for the CPU reference
// (src/ops/cpu/) and the CUDA kernels (src/ops/cuda/). Every value is computed in f32; callers
// round the results to the tensor's dtype.
//
// Derivations (C = columns of a row, g = gamma, dy = the output gradient):
//   LayerNorm: xhat = (x - mean) * rstd, y = xhat * g + beta, dxhat = dy * g.
//     dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)).
//   RMSNorm:   rstd = 1 / sqrt(mean(x^2) + eps), xhat = x * rstd, y = xhat * g. From
//     d rstd / d x_j = -rstd^3 * x_j / C:
//     dx_j = rstd * dxhat_j - rstd^3 * x_j * mean(dxhat * x) = rstd * (dxhat_j - xhat_j *
//     mean(dxhat * xhat)): LayerNorm's formula with mean = 0 and without the mean(dxhat) term.
//   Both: dgamma = sum over rows of dy * xhat, dbeta = sum over rows of dy.
//   GELU (tanh): u = k0 (x + k1 x^3), t = tanh(u), y = x (1 + t) / 2 = x sigmoid(2u),
//     y' = (1 + t) / 2 + x (1 - t^2) k0 (1 + 3 k1 x^2) / 2.
//   SiLU: s = 1 / (1 + exp(-g)), silu(g) = g / (1 + exp(-g)), silu'(g) = s (1 + g (1 - s)).
//   SwiGLU: y = silu(gate) * up; dgate = dy * up * silu'(gate), dup = dy * silu(gate).
//   SReLU: r = max(x, 0), y = r^2, y' = 2 r.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "octet/fp8/format.h"  // OCTET_HD, bf16 encoding
#include "octet/ops/activation.h"

namespace octet::ops::math {

// ----------------------------------------------------------------------------
// Elements: f32 tensors hold float, bf16 tensors hold uint16_t bits (encode_bf16: round to
// nearest even, as CUDA's __float2bfloat16_rn).

OCTET_HD float to_float(float v) { return v; }
OCTET_HD float to_float(uint16_t v) { return fp8::decode_bf16(v); }

template <typename T>
OCTET_HD T from_float(float v) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return v;
  } else {
    return fp8::encode_bf16(v);
  }
}

/// Calls f(T{}) with T = float for an f32 tensor and uint16_t for a bf16 one (host code).
template <typename F>
void visit_dtype(DType dtype, F&& f) {
  if (dtype == DType::f32) {
    f(float{});
  } else {
    f(uint16_t{});
  }
}

/// sqrt(2 / pi) and the cubic coefficient of GELU's tanh approximation (Hendrycks & Gimpel,
/// "Gaussian Error Linear Units", 2016, section 2).
inline constexpr float kGeluK0 = 0.7978845608028654f;
inline constexpr float kGeluK1 = 0.044715f;

// ----------------------------------------------------------------------------
// Norms

/// 1 / sqrt(var + eps) with IEEE sqrt and division (nvcc's defaults, as on the host).
OCTET_HD float norm_rstd(float var, float eps) { return 1.0f / sqrtf(var + eps); }

/// One output of LayerNorm, (x - mean) * rstd * gamma + beta; RMSNorm passes mean = beta = 0.
OCTET_HD float norm_output(float x, float mean, float rstd, float gamma, float beta) {
  return (x - mean) * rstd * gamma + beta;
}

/// xhat = (x - mean) * rstd, the normalized input (mean = 0 for RMSNorm).
OCTET_HD float norm_xhat(float x, float mean, float rstd) { return (x - mean) * rstd; }

/// One input gradient of either norm: rstd * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat),
/// where RMSNorm passes mean_dxhat = 0 (see the derivation above).
OCTET_HD float norm_dx(float dxhat, float xhat, float rstd, float mean_dxhat,
                       float mean_dxhat_xhat) {
  return rstd * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat);
}

// ----------------------------------------------------------------------------
// Activations

// GELU is written as x * sigmoid(2u), which is x (1 + tanh(u)) / 2, and GELU and SiLU take their
// exponential and division from two helpers. On the device those are the special-function unit's
// (__expf: MUFU.EX2; __fdividef: MUFU.RCP): the accurate expf and IEEE division made the fused
// activation tile kernels instruction-bound (ncu at GPT-2 1.5B's shapes: 68-72% of SM throughput
// against 34-45% of DRAM's). __expf is within 2 + 1.2|x| ulps, which keeps every output inside
// the f32 elementwise bound of the parity tests (4e-6 of the terms' magnitude) for the arguments
// that are not saturated. The host, the CPU reference, takes libm's expf and IEEE division: the
// same expressions, rounded once each (libm's tanhf took four times as long an element and made
// GELU a quarter of the CPU's training step). The exponent of GELU's sigmoid is clamped at 80 so
// that 1 + e stays below 2^126, where __fdividef returns 0, and e * s (= 1 - s) stays finite.
inline constexpr float kGeluMaxExponent = 80.0f;

/// e^x: the special-function unit's on the device, libm's expf on the host.
OCTET_HD float activation_exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);
#else
  return expf(x);
#endif
}

/// a / b: the special-function unit's reciprocal on the device, IEEE division on the host.
OCTET_HD float activation_divide(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdividef(a, b);
#else
  return a / b;
#endif
}

/// x sigmoid(2u) = x / (1 + e), e = exp(-2u) clamped, u = k0 (x + k1 x^3).
OCTET_HD float gelu(float x) {
  const float e =
      activation_exp(fminf(-2.0f * kGeluK0 * (x + kGeluK1 * x * x * x), kGeluMaxExponent));
  return activation_divide(x, 1.0f + e);
}

/// d gelu / dx, exact for the tanh form (not the erf form). With s = sigmoid(2u) = (1 + t) / 2:
/// 1 - t^2 = 4 s (1 - s), so y' = s + 2 x s (1 - s) k0 (1 + 3 k1 x^2).
OCTET_HD float gelu_grad(float x) {
  const float x2 = x * x;
  const float e =
      activation_exp(fminf(-2.0f * kGeluK0 * (x + kGeluK1 * x2 * x), kGeluMaxExponent));
  const float s = activation_divide(1.0f, 1.0f + e);
  return s + 2.0f * x * s * (e * s) * kGeluK0 * (1.0f + 3.0f * kGeluK1 * x2);
}

/// g / (1 + exp(-g)): -0 (not NaN) for very negative g, where exp overflows to inf (on the
/// device __fdividef(g, inf) is g * 0).
OCTET_HD float silu(float g) { return activation_divide(g, 1.0f + activation_exp(-g)); }

/// d silu / dg = s (1 + g (1 - s)), s = sigmoid(g).
OCTET_HD float silu_grad(float g) {
  const float s = activation_divide(1.0f, 1.0f + activation_exp(-g));
  return s * (1.0f + g * (1.0f - s));
}

/// max(x, 0) written so that a NaN input stays NaN (fmaxf would drop it).
OCTET_HD float relu(float x) { return x < 0.0f ? 0.0f : x; }

OCTET_HD float srelu(float x) {
  const float r = relu(x);
  return r * r;
}

OCTET_HD float srelu_grad(float x) { return 2.0f * relu(x); }

OCTET_HD float swiglu(float gate, float up) { return silu(gate) * up; }
OCTET_HD float swiglu_dgate(float dy, float gate, float up) { return dy * up * silu_grad(gate); }
OCTET_HD float swiglu_dup(float dy, float gate) { return dy * silu(gate); }

/// Calls f(std::integral_constant<Activation, act>{}) (host code), so kernels and loops get the
/// activation as a compile-time constant.
template <typename F>
void visit_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::gelu:
      f(std::integral_constant<Activation, Activation::gelu>{});
      return;
    case Activation::swiglu:
      f(std::integral_constant<Activation, Activation::swiglu>{});
      return;
    case Activation::srelu:
      f(std::integral_constant<Activation, Activation::srelu>{});
      return;
  }
}

/// y = act(x) for the elementwise activations (not swiglu, which takes two inputs).
template <Activation kAct>
OCTET_HD float activate(float x) {
  static_assert(kAct != Activation::swiglu, "swiglu takes gate and up: use swiglu()");
  if constexpr (kAct == Activation::gelu) {
    return gelu(x);
  } else {
    return srelu(x);
  }
}

/// d act / dx for the elementwise activations.
template <Activation kAct>
OCTET_HD float activate_grad(float x) {
  static_assert(kAct != Activation::swiglu, "swiglu takes gate and up: use swiglu_dgate()");
  if constexpr (kAct == Activation::gelu) {
    return gelu_grad(x);
  } else {
    return srelu_grad(x);
  }
}

}  // namespace octet::ops::math
