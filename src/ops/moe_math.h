// Scalar and per-row formulas of the MoE family (include/octet/ops/moe.h), written once for the CPU
// reference (src/ops/cpu/moe.cc) and the CUDA kernels (src/ops/cuda/moe.cu).
//
// Router, per token (E experts, serial over them in index order on both backends):
//   m = max_e l_e, sum = sum_e exp(l_e - m), lse = m + log(sum).
//   softmax: s_e = exp(l_e - m) / sum, selection key l_e (monotone in s_e, and exact everywhere).
//   sigmoid: s_e = 1 / (1 + exp(-l_e)), selection key s_e + bias_e.
//   top-k: k passes, each taking the largest key not yet taken (lower index on ties; NaN keys
//   never win). p_i = s_{e_i} / S, S = sum_i s_{e_i}.
// Backward, with g_e = dL/ds_e:
//   g_e = aux_coef * E * f_e / T (f_e = counts_e / (T k)) + [e = e_i] (dp_i - sum_i' dp_i' p_i') / S
//   softmax: dl_e = s_e (g_e - sum_e' g_e' s_e');  sigmoid: dl_e = g_e s_e (1 - s_e);
//   z-loss: dl_e += z_coef * 2 lse / T * softmax_e(l).
// Each sum and product that feeds a sum is one rn:: operation, so nvcc cannot contract it into an
// FMA and both backends round the same way; the exp/log/activation values themselves may differ
// by an ulp between the host's libm and the device (docs/DETERMINISM.md, the parity tolerances).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "octet/fp8/format.h"  // OCTET_HD
#include "octet/ops/moe.h"
#include "ops/activation_math.h"
#include "ops/optimizer_math.h"  // rn::
#include "ops/sorted_search.h"

namespace octet::ops::moe {

#if defined(__CUDA_ARCH__)
OCTET_HD float exp_f(float x) { return expf(x); }
OCTET_HD float log_f(float x) { return logf(x); }
#else
inline float exp_f(float x) { return std::exp(x); }
inline float log_f(float x) { return std::log(x); }
#endif

// ----------------------------------------------------------------------------
// Router

/// Per-token forward: writes scores[E], expert[k], prob[k]; returns lse. bias may be null.
OCTET_HD float router_row_forward(const float* logits, int64_t experts, int64_t topk,
                                  RouterScoring scoring, const float* bias, float* scores,
                                  int32_t* expert, float* prob) {
  float m = -INFINITY;
  for (int64_t e = 0; e < experts; ++e) m = logits[e] > m ? logits[e] : m;
  float sum = 0.0f;
  for (int64_t e = 0; e < experts; ++e) sum = rn::add(sum, exp_f(rn::add(logits[e], -m)));
  const float lse = rn::add(m, log_f(sum));
  for (int64_t e = 0; e < experts; ++e)
    scores[e] = scoring == RouterScoring::softmax
                    ? rn::div(exp_f(rn::add(logits[e], -m)), sum)
                    : rn::div(1.0f, rn::add(1.0f, exp_f(-logits[e])));
  for (int64_t i = 0; i < topk; ++i) {
    int64_t best = -1;
    float best_key = 0.0f;
    for (int64_t e = 0; e < experts; ++e) {
      bool taken = false;
      for (int64_t j = 0; j < i; ++j) taken = taken || expert[j] == e;
      if (taken) continue;
      const float key = scoring == RouterScoring::softmax
                            ? logits[e]
                            : (bias != nullptr ? rn::add(scores[e], bias[e]) : scores[e]);
      if (best < 0 || key > best_key) best = e, best_key = key;
    }
    expert[i] = static_cast<int32_t>(best);
  }
  float selected = 0.0f;
  for (int64_t i = 0; i < topk; ++i) selected = rn::add(selected, scores[expert[i]]);
  for (int64_t i = 0; i < topk; ++i) prob[i] = rn::div(scores[expert[i]], selected);
  return lse;
}

/// dL/ds_e of the aux loss: aux_coef * E * f_e / T, with f_e = counts_e / (T k).
OCTET_HD float aux_score_grad(float aux_coef, int32_t count, int64_t tokens, int64_t experts,
                              int64_t topk) {
  const float f = rn::div(static_cast<float>(count), static_cast<float>(tokens * topk));
  return rn::div(rn::mul(rn::mul(aux_coef, static_cast<float>(experts)), f),
                 static_cast<float>(tokens));
}

/// Per-token backward into dlogits[E] (see the derivation above); counts null when the aux loss
/// is off, z_scale = z_coef * 2 / T (0 when off).
OCTET_HD void router_row_backward(const float* logits, const float* scores, const int32_t* expert,
                                  const float* prob, const float* dprob, float lse,
                                  const int32_t* counts, float aux_coef, float z_scale,
                                  int64_t tokens, int64_t experts, int64_t topk,
                                  RouterScoring scoring, float* dlogits) {
  for (int64_t e = 0; e < experts; ++e)
    dlogits[e] =
        counts != nullptr ? aux_score_grad(aux_coef, counts[e], tokens, experts, topk) : 0.0f;
  float selected = 0.0f, dp_dot_p = 0.0f;
  for (int64_t i = 0; i < topk; ++i) {
    selected = rn::add(selected, scores[expert[i]]);
    dp_dot_p = rn::add(dp_dot_p, rn::mul(dprob[i], prob[i]));
  }
  for (int64_t i = 0; i < topk; ++i)
    dlogits[expert[i]] = rn::add(dlogits[expert[i]], rn::div(rn::add(dprob[i], -dp_dot_p), selected));
  if (scoring == RouterScoring::softmax) {
    float g_dot_s = 0.0f;
    for (int64_t e = 0; e < experts; ++e) g_dot_s = rn::add(g_dot_s, rn::mul(dlogits[e], scores[e]));
    for (int64_t e = 0; e < experts; ++e)
      dlogits[e] = rn::mul(scores[e], rn::add(dlogits[e], -g_dot_s));
  } else {
    for (int64_t e = 0; e < experts; ++e)
      dlogits[e] = rn::mul(rn::mul(dlogits[e], scores[e]), rn::add(1.0f, -scores[e]));
  }
  if (z_scale != 0.0f) {
    const float z = rn::mul(z_scale, lse);
    for (int64_t e = 0; e < experts; ++e) {
      const float softmax_e = scoring == RouterScoring::softmax
                                  ? scores[e]
                                  : exp_f(rn::add(logits[e], -lse));
      dlogits[e] = rn::add(dlogits[e], rn::mul(z, softmax_e));
    }
  }
}

/// z_coef * 2 / T: the z-loss's dL/dlse_t is this times lse_t.
OCTET_HD float z_score_scale(float z_coef, int64_t tokens) {
  return rn::div(rn::mul(z_coef, 2.0f), static_cast<float>(tokens));
}

/// aux = coef * E * sum_e f_e P_e (serial over e), P_e = score_sums[e] / T.
OCTET_HD float aux_loss_value(float coef, const int32_t* counts, const float* score_sums,
                              int64_t tokens, int64_t experts, int64_t topk) {
  float acc = 0.0f;
  for (int64_t e = 0; e < experts; ++e) {
    const float f = rn::div(static_cast<float>(counts[e]), static_cast<float>(tokens * topk));
    const float p = rn::div(score_sums[e], static_cast<float>(tokens));
    acc = rn::add(acc, rn::mul(f, p));
  }
  return rn::mul(rn::mul(coef, static_cast<float>(experts)), acc);
}

/// z = coef * (sum_t lse_t^2) / T.
OCTET_HD float z_loss_value(float coef, float lse_square_sum, int64_t tokens) {
  return rn::mul(coef, rn::div(lse_square_sum, static_cast<float>(tokens)));
}

// ----------------------------------------------------------------------------
// Activations (activation_math.h's formulas; geglu is gelu(gate) * up)

OCTET_HD constexpr bool gated(MoeActivation act) {
  return act == MoeActivation::swiglu || act == MoeActivation::geglu;
}

/// act for one output element; `up` is read only by the gated activations.
template <MoeActivation kAct>
OCTET_HD float activate(float x, float up) {
  if constexpr (kAct == MoeActivation::swiglu) {
    return math::swiglu(x, up);
  } else if constexpr (kAct == MoeActivation::geglu) {
    return math::gelu(x) * up;
  } else if constexpr (kAct == MoeActivation::srelu) {
    return math::srelu(x);
  } else {
    return math::gelu(x);
  }
}

/// d act for output gradient g: dx (the gate for gated activations) and dup (gated only).
template <MoeActivation kAct>
OCTET_HD void activate_grad(float g, float x, float up, float& dx, float& dup) {
  if constexpr (kAct == MoeActivation::swiglu) {
    dx = math::swiglu_dgate(g, x, up);
    dup = math::swiglu_dup(g, x);
  } else if constexpr (kAct == MoeActivation::geglu) {
    dx = g * up * math::gelu_grad(x);
    dup = g * math::gelu(x);
  } else if constexpr (kAct == MoeActivation::srelu) {
    dx = g * math::srelu_grad(x);
  } else {
    dx = g * math::gelu_grad(x);
  }
}

/// Calls f(std::integral_constant<MoeActivation, act>{}) (host code).
template <typename F>
void visit_activation(MoeActivation act, F&& f) {
  switch (act) {
    case MoeActivation::swiglu:
      f(std::integral_constant<MoeActivation, MoeActivation::swiglu>{});
      return;
    case MoeActivation::geglu:
      f(std::integral_constant<MoeActivation, MoeActivation::geglu>{});
      return;
    case MoeActivation::srelu:
      f(std::integral_constant<MoeActivation, MoeActivation::srelu>{});
      return;
    case MoeActivation::gelu:
      f(std::integral_constant<MoeActivation, MoeActivation::gelu>{});
      return;
  }
}

/// The expert owning permuted row r (offsets[experts] <= r: none, -1), by binary search.
OCTET_HD int32_t expert_of_row(const int32_t* offsets, int64_t experts, int64_t r) {
  if (r >= offsets[experts]) return -1;
  return static_cast<int32_t>(last_start_at_most(offsets, experts, r));
}

}  // namespace octet::ops::moe
