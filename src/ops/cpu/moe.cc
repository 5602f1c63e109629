// CPU reference of the MoE family: plain loops (OpenMP over independent rows) that perform exactly
// the operations of the CUDA kernels in the same order: the per-token router formulas of
// moe_math.h, serial slot sums, per-row dots in fixed_order_reduce.h's order, and dbias as
// per-tile partials summed tile by tile.
#include <cstring>
#include <vector>

#include "ops/fixed_order_reduce.h"
#include "ops/moe_backend.h"
#include "ops/moe_math.h"
#include "ops/raw_access.h"

namespace octet::ops::cpu {
namespace {

using math::from_float;
using math::to_float;

/// Reads row_map's (token, slot) of permuted row r.
struct RowSource {
  int32_t token, slot;
};
RowSource row_source(const MoePlan& plan, int64_t r) {
  const int32_t* map = in<int32_t>(plan.row_map);
  return {map[2 * r], map[2 * r + 1]};
}

}  // namespace

void router_forward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& o) {
  const int64_t tokens = logits.rows(), experts = logits.cols(), topk = args.topk;
  const float* l = in<float>(logits);
  const float* bias = args.selection_bias.defined() ? in<float>(args.selection_bias) : nullptr;
  float* scores = out<float>(o.scores);
  int32_t* expert = out<int32_t>(o.expert);
  float* prob = out<float>(o.prob);
  float* lse = out<float>(o.lse);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t)
    lse[t] = moe::router_row_forward(l + t * experts, experts, topk, args.scoring, bias,
                                     scores + t * experts, expert + t * topk, prob + t * topk);
  int32_t* counts = out<int32_t>(o.counts);
  std::memset(counts, 0, experts * sizeof(int32_t));
  for (int64_t i = 0; i < tokens * topk; ++i) ++counts[expert[i]];
  std::vector<float> score_sums(experts);
  for (int64_t e = 0; e < experts; ++e)
    score_sums[e] = fixed_order_reduce<kMoeDotLanes, float>(
        tokens, SumOp{}, [&](int64_t t) { return scores[t * experts + e]; });
  const float lse_square_sum = fixed_order_reduce<kMoeDotLanes, float>(
      tokens, SumOp{}, [&](int64_t t) { return rn::mul(lse[t], lse[t]); });
  out<float>(o.aux_loss)[0] =
      args.aux_loss_coef > 0.0f ? moe::aux_loss_value(args.aux_loss_coef, counts,
                                                       score_sums.data(), tokens, experts, topk)
                                : 0.0f;
  out<float>(o.z_loss)[0] =
      args.z_loss_coef > 0.0f ? moe::z_loss_value(args.z_loss_coef, lse_square_sum, tokens) : 0.0f;
}

void router_backward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& s,
                     const Tensor& dprob, const Tensor& dlogits) {
  const int64_t tokens = logits.rows(), experts = logits.cols(), topk = args.topk;
  const int32_t* counts = args.aux_loss_coef > 0.0f ? in<int32_t>(s.counts) : nullptr;
  const float z_scale =
      args.z_loss_coef > 0.0f ? moe::z_score_scale(args.z_loss_coef, tokens) : 0.0f;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t)
    moe::router_row_backward(in<float>(logits) + t * experts, in<float>(s.scores) + t * experts,
                             in<int32_t>(s.expert) + t * topk, in<float>(s.prob) + t * topk,
                             in<float>(dprob) + t * topk, in<float>(s.lse)[t], counts,
                             args.aux_loss_coef, z_scale, tokens, experts, topk, args.scoring,
                             out<float>(dlogits) + t * experts);
}

void moe_plan(const Tensor& expert_t, const MoePlan& plan) {
  const int64_t slots = expert_t.numel(), topk = expert_t.size(1), experts = plan.experts();
  const int32_t* expert = in<int32_t>(expert_t);
  std::vector<int32_t> position(slots), count(experts, 0);
  for (int64_t i = 0; i < slots; ++i) position[i] = count[expert[i]]++;
  int32_t* offsets = out<int32_t>(plan.offsets);
  offsets[0] = 0;
  for (int64_t e = 0; e < experts; ++e)
    offsets[e + 1] = offsets[e] + static_cast<int32_t>((count[e] + kMoeGroupAlign - 1) /
                                                       kMoeGroupAlign * kMoeGroupAlign);
  int32_t* row_map = out<int32_t>(plan.row_map);
  std::memset(row_map, 0xFF, plan.row_map.nbytes());  // every i32 -1
  int32_t* slot_row = out<int32_t>(plan.slot_row);
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t row = offsets[expert[i]] + position[i];
    slot_row[i] = row;
    row_map[2 * row] = static_cast<int32_t>(i / topk);
    row_map[2 * row + 1] = static_cast<int32_t>(i % topk);
  }
}

void moe_dispatch(const Tensor& x, const MoePlan& plan, const Tensor& permuted) {
  const int64_t row_bytes = x.cols() * dtype_size(x.dtype()), rows = plan.capacity();
  const auto* src = static_cast<const uint8_t*>(x.raw_data());
  auto* dst = static_cast<uint8_t*>(permuted.raw_data());
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const RowSource s = row_source(plan, r);
    if (s.token < 0) {
      std::memset(dst + r * row_bytes, 0, row_bytes);
    } else {
      std::memcpy(dst + r * row_bytes, src + s.token * row_bytes, row_bytes);
    }
  }
}

void moe_dispatch_backward(const Tensor& d_permuted, const MoePlan& plan, const Tensor& dx) {
  const int64_t tokens = dx.rows(), dim = dx.cols(), topk = plan.slot_row.size(1);
  const int32_t* slot_row = in<int32_t>(plan.slot_row);
  math::visit_dtype(dx.dtype(), [&](auto type) {
    using T = decltype(type);
    const T* dp = in<T>(d_permuted);
    T* d = out<T>(dx);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t c = 0; c < dim; ++c) {
        float acc = 0.0f;
        for (int64_t s = 0; s < topk; ++s)
          acc = rn::add(acc, to_float(dp[slot_row[t * topk + s] * dim + c]));
        d[t * dim + c] = from_float<T>(acc);
      }
  });
}

void moe_combine(const Tensor& expert_out, const Tensor& prob, const MoePlan& plan,
                 const Tensor& y) {
  const int64_t tokens = y.rows(), dim = y.cols(), topk = plan.slot_row.size(1);
  const int32_t* slot_row = in<int32_t>(plan.slot_row);
  const float* p = prob.defined() ? in<float>(prob) : nullptr;
  math::visit_dtype(y.dtype(), [&](auto type) {
    using T = decltype(type);
    const T* eo = in<T>(expert_out);
    T* yo = out<T>(y);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t c = 0; c < dim; ++c) {
        float acc = 0.0f;
        for (int64_t s = 0; s < topk; ++s) {
          const float v = to_float(eo[slot_row[t * topk + s] * dim + c]);
          acc = rn::add(acc, p != nullptr ? rn::mul(p[t * topk + s], v) : v);
        }
        yo[t * dim + c] = from_float<T>(acc);
      }
  });
}

void moe_combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& prob,
                          const MoePlan& plan, const Tensor& d_expert_out, const Tensor& dprob) {
  const int64_t dim = dy.cols(), topk = plan.slot_row.size(1), rows = plan.capacity();
  const float* p = prob.defined() ? in<float>(prob) : nullptr;
  math::visit_dtype(dy.dtype(), [&](auto type) {
    using T = decltype(type);
    const T* g = in<T>(dy);
    T* d = out<T>(d_expert_out);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const RowSource s = row_source(plan, r);
      for (int64_t c = 0; c < dim; ++c) {
        if (s.token < 0) {
          d[r * dim + c] = from_float<T>(0.0f);
          continue;
        }
        const float gv = to_float(g[s.token * dim + c]);
        d[r * dim + c] = from_float<T>(p != nullptr ? rn::mul(p[s.token * topk + s.slot], gv) : gv);
      }
      if (p == nullptr || s.token < 0) continue;
      const T* eo = in<T>(expert_out) + r * dim;
      const T* gr = g + s.token * dim;
      out<float>(dprob)[s.token * topk + s.slot] = fixed_order_reduce<kMoeDotLanes, float>(
          dim, SumOp{}, [&](int64_t c) { return rn::mul(to_float(gr[c]), to_float(eo[c])); });
    }
  });
}

void moe_gather_row_probs(const Tensor& prob, const MoePlan& plan, const Tensor& row_prob) {
  const int64_t topk = plan.slot_row.size(1);
  for (int64_t r = 0; r < plan.capacity(); ++r) {
    const RowSource s = row_source(plan, r);
    out<float>(row_prob)[r] = s.token < 0 ? 0.0f : in<float>(prob)[s.token * topk + s.slot];
  }
}

void moe_scatter_row_probs(const Tensor& d_row_prob, const MoePlan& plan, const Tensor& dprob) {
  for (int64_t i = 0; i < plan.slot_row.numel(); ++i)
    out<float>(dprob)[i] = in<float>(d_row_prob)[in<int32_t>(plan.slot_row)[i]];
}

namespace {

/// Runs f(T{}, kAct) for fc1's dtype and the activation.
template <typename F>
void visit(MoeActivation act, DType dtype, F&& f) {
  math::visit_dtype(dtype, [&](auto type) {
    moe::visit_activation(act, [&](auto a) { f(type, a); });
  });
}

}  // namespace

void moe_scaled_activation_forward(MoeActivation act, const Tensor& fc1, const Tensor& row_prob,
                                   const MoePlan& plan, const Tensor& bias, const Tensor& h) {
  const int64_t rows = h.rows(), f = h.cols(), in_cols = fc1.cols(), experts = plan.experts();
  const int32_t* offsets = in<int32_t>(plan.offsets);
  const float* b = bias.defined() ? in<float>(bias) : nullptr;
  visit(act, fc1.dtype(), [&](auto type, auto a) {
    using T = decltype(type);
    constexpr MoeActivation kAct = decltype(a)::value;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* x = in<T>(fc1) + r * in_cols;
      T* y = out<T>(h) + r * f;
      const int32_t e = moe::expert_of_row(offsets, experts, r);
      if (row_source(plan, r).token < 0 || e < 0) {
        for (int64_t j = 0; j < f; ++j) y[j] = from_float<T>(0.0f);
        continue;
      }
      const float p = in<float>(row_prob)[r];
      for (int64_t j = 0; j < f; ++j) {
        float v = moe::activate<kAct>(to_float(x[j]), moe::gated(kAct) ? to_float(x[f + j]) : 0.0f);
        if (b != nullptr) v = rn::add(v, b[e * f + j]);
        y[j] = from_float<T>(rn::mul(v, p));
      }
    }
  });
}

void moe_scaled_activation_backward(MoeActivation act, const Tensor& dh, const Tensor& fc1,
                                    const Tensor& row_prob, const MoePlan& plan,
                                    const Tensor& bias, const Tensor& dfc1,
                                    const Tensor& d_row_prob, const Tensor& dbias) {
  const int64_t rows = dh.rows(), f = dh.cols(), in_cols = fc1.cols(), experts = plan.experts();
  const int32_t* offsets = in<int32_t>(plan.offsets);
  const float* b = bias.defined() ? in<float>(bias) : nullptr;
  const float* p = in<float>(row_prob);
  visit(act, fc1.dtype(), [&](auto type, auto a) {
    using T = decltype(type);
    constexpr MoeActivation kAct = decltype(a)::value;
    constexpr bool kGated = moe::gated(kAct);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* x = in<T>(fc1) + r * in_cols;
      const T* g = in<T>(dh) + r * f;
      T* dx = out<T>(dfc1) + r * in_cols;
      const int32_t e = moe::expert_of_row(offsets, experts, r);
      if (row_source(plan, r).token < 0 || e < 0) {
        for (int64_t j = 0; j < in_cols; ++j) dx[j] = from_float<T>(0.0f);
        out<float>(d_row_prob)[r] = 0.0f;
        continue;
      }
      for (int64_t j = 0; j < f; ++j) {
        const float xv = to_float(x[j]), up = kGated ? to_float(x[f + j]) : 0.0f;
        float dgate = 0.0f, dup = 0.0f;
        moe::activate_grad<kAct>(rn::mul(to_float(g[j]), p[r]), xv, up, dgate, dup);
        dx[j] = from_float<T>(dgate);
        if constexpr (kGated) dx[f + j] = from_float<T>(dup);
      }
      out<float>(d_row_prob)[r] =
          fixed_order_reduce<kMoeDotLanes, float>(f, SumOp{}, [&](int64_t j) {
            float v = moe::activate<kAct>(to_float(x[j]), kGated ? to_float(x[f + j]) : 0.0f);
            if (b != nullptr) v = rn::add(v, b[e * f + j]);
            return rn::mul(to_float(g[j]), v);
          });
    }
  });
  if (!dbias.defined()) return;
  // Partials per kMoeBiasTileRows-row tile (rows in order, padding rows skipped), then per
  // expert its tiles in order: the CUDA kernels' two passes.
  const int64_t tiles = rows / kMoeBiasTileRows;
  std::vector<float> partial(tiles * f);
  math::visit_dtype(dh.dtype(), [&](auto type) {
    using T = decltype(type);
#pragma omp parallel for schedule(static)
    for (int64_t tile = 0; tile < tiles; ++tile)
      for (int64_t j = 0; j < f; ++j) {
        float acc = 0.0f;
        for (int64_t r = tile * kMoeBiasTileRows; r < (tile + 1) * kMoeBiasTileRows; ++r)
          if (row_source(plan, r).token >= 0)
            acc = rn::add(acc, rn::mul(to_float(in<T>(dh)[r * f + j]), p[r]));
        partial[tile * f + j] = acc;
      }
  });
  float* db = out<float>(dbias);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t j = 0; j < f; ++j) {
      float acc = 0.0f;
      for (int64_t tile = offsets[e] / kMoeBiasTileRows; tile < offsets[e + 1] / kMoeBiasTileRows;
           ++tile)
        acc = rn::add(acc, partial[tile * f + j]);
      db[e * f + j] = acc;
    }
}

}  // namespace octet::ops::cpu
