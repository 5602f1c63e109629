// nn::MoE: for every expert activation, the forward against a plain per-token reference (softmax
// top-k, each chosen expert's Linears run on the token alone) and finite differences for dx and
// the router weight (their gradients flow through dprob and the aux and z losses); activation
// recompute bitwise equal to no recompute under BF16 and FP8 delayed scaling; the fused per-expert
// cast of FC2's input bitwise equal to the unfused path; empty experts; and on a GPU, runs at the
// field shape of FIELD-NOTES section 3 that repeat byte for byte.
#include "octet/nn/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "nn/nn_check.h"
#include "octet/nn/autocast.h"
#include "octet/nn/fusion.h"
#include "test_util.h"

namespace octet::nn {
namespace {

using fp8::Recipe;
using testing::bitwise_equal;
using testing::fresh_seed;
using testing::state_tensors;

BlockConfig moe_config(int64_t dim, int64_t ffn, int64_t experts, int64_t topk,
                       ops::MoeActivation act) {
  BlockConfig c;
  c.dim = dim;
  c.heads = 1;
  c.ffn = ffn;
  c.bias = true;
  c.moe.experts = experts;
  c.moe.topk = topk;
  c.moe.activation = act;
  c.moe.aux_loss_coef = 0.01f;
  c.moe.z_loss_coef = 0.001f;
  c.moe.activation_bias = true;
  return c;
}

std::vector<float> host(const Tensor& t) { return testing::to_floats(t); }

/// The tanh GELU in double.
double gelu_tanh(double x) {
  const double k = std::sqrt(2.0 / std::acos(-1.0));
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

/// The expert activation of one output in double; `up` is read by the gated ones only.
double activate(ops::MoeActivation act, double x, double up) {
  switch (act) {
    case ops::MoeActivation::swiglu:
      return x / (1 + std::exp(-x)) * up;
    case ops::MoeActivation::geglu:
      return gelu_tanh(x) * up;
    case ops::MoeActivation::srelu:
      return x > 0 ? x * x : 0.0;
    case ops::MoeActivation::gelu:
      return gelu_tanh(x);
  }
  return 0.0;
}

/// The reference of one token: softmax over the logits, the top k (ties: lower index), their
/// probabilities renormalised; each chosen expert's fc1, activation (+ bias) times the
/// probability, fc2; the sum over the chosen experts. Everything in double on the host.
std::vector<double> reference_token(const MoE& moe, const std::vector<float>& x) {
  const int64_t experts = moe.experts(), topk = moe.config().topk;
  const int64_t dim = static_cast<int64_t>(x.size());
  const std::vector<float> wr = host(moe.router_weight());
  std::vector<double> logits(experts);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t d = 0; d < dim; ++d) logits[e] += double(x[d]) * wr[e * dim + d];
  const double top = *std::max_element(logits.begin(), logits.end());
  std::vector<double> score(experts);
  for (int64_t e = 0; e < experts; ++e) score[e] = std::exp(logits[e] - top);
  std::vector<int64_t> order(experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return score[a] > score[b]; });
  double chosen_sum = 0;
  for (int64_t s = 0; s < topk; ++s) chosen_sum += score[order[s]];
  const std::vector<float> bias = host(moe.activation_bias());
  std::vector<double> y(dim, 0.0);
  for (int64_t s = 0; s < topk; ++s) {
    const int64_t e = order[s];
    const double prob = score[e] / chosen_sum;
    const Linear& fc1 = moe.fc1().expert(e);
    const Linear& fc2 = moe.fc2().expert(e);
    const std::vector<float> w1 = host(fc1.weight()), b1 = host(fc1.bias());
    const std::vector<float> w2 = host(fc2.weight()), b2 = host(fc2.bias());
    const int64_t f = fc2.in_features();
    const ops::MoeActivation act = moe.config().activation;
    const bool gated = fc1.out_features() == 2 * f;
    std::vector<double> h(f);
    for (int64_t j = 0; j < f; ++j) {
      double gate = b1[j], up = gated ? b1[f + j] : 0.0;
      for (int64_t d = 0; d < dim; ++d) {
        gate += double(x[d]) * w1[j * dim + d];
        if (gated) up += double(x[d]) * w1[(f + j) * dim + d];
      }
      h[j] = (activate(act, gate, up) + bias[e * f + j]) * prob;
    }
    for (int64_t d = 0; d < dim; ++d) {
      double acc = b2[d];
      for (int64_t j = 0; j < f; ++j) acc += h[j] * w2[d * f + j];
      y[d] += acc;
    }
  }
  return y;
}

/// Gives the activation bias non-zero values, so its path is exercised.
void randomize_activation_bias(MoE& moe, uint64_t seed) {
  Tensor bias = moe.activation_bias();
  bias.copy_from(testing::random_tensor(bias.shape(), DType::f32, seed, 0.1f));
}

/// Every expert activation: the forward against the per-token reference, the gradients against
/// finite differences.
class MoEActivation : public ::testing::TestWithParam<ops::MoeActivation> {};

TEST_P(MoEActivation, ForwardMatchesPerTokenReference) {
  const int64_t tokens = 12, dim = 32, ffn = 16;
  MoE moe(moe_config(dim, ffn, 4, 2, GetParam()), Device::cpu(), fresh_seed(), DType::f32);
  randomize_activation_bias(moe, fresh_seed());
  const Tensor x = testing::random_tensor({tokens, dim}, DType::f32, fresh_seed());
  MoE::Saved saved;
  const std::vector<float> y = host(moe.forward(x, saved));
  const std::vector<float> xs = host(x);
  double worst = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const std::vector<float> row(xs.begin() + t * dim, xs.begin() + (t + 1) * dim);
    const std::vector<double> ref = reference_token(moe, row);
    for (int64_t d = 0; d < dim; ++d)
      worst = std::max(worst, std::abs(ref[d] - y[t * dim + d]) / (1.0 + std::abs(ref[d])));
  }
  EXPECT_LT(worst, 1e-5) << "largest relative difference from the per-token reference";
  const MoE::Load load = *moe.last_load();
  EXPECT_EQ(std::accumulate(load.tokens.begin(), load.tokens.end(), int64_t{0}), tokens * 2);
  EXPECT_GT(load.aux_loss, 0.0f);
  EXPECT_GT(load.z_loss, 0.0f);
}

/// L = sum(g * y) + aux + z for the module's current parameters.
double loss_of(MoE& moe, const Tensor& x, const std::vector<float>& g) {
  MoE::Saved saved;
  const std::vector<float> y = host(moe.forward(x, saved));
  double l = 0;
  for (size_t i = 0; i < y.size(); ++i) l += double(g[i]) * y[i];
  const MoE::Load load = *moe.last_load();
  return l + load.aux_loss + load.z_loss;
}

/// Whether every token's k-th best logit beats the (k+1)-th by `margin`: a perturbation smaller
/// than that cannot change the choice of experts (finite differences need a smooth loss).
bool clear_choices(const MoE& moe, const Tensor& x, double margin) {
  const std::vector<float> wr = host(moe.router_weight()), xs = host(x);
  const int64_t experts = moe.experts(), dim = x.cols(), k = moe.config().topk;
  for (int64_t t = 0; t < x.rows(); ++t) {
    std::vector<double> logits(experts);
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t d = 0; d < dim; ++d) logits[e] += double(xs[t * dim + d]) * wr[e * dim + d];
    std::sort(logits.rbegin(), logits.rend());
    if (logits[k - 1] - logits[k] < margin) return false;
  }
  return true;
}

TEST_P(MoEActivation, GradientsMatchFiniteDifferences) {
  const int64_t tokens = 8, dim = 16, ffn = 16;
  constexpr double kEps = 1e-2;
  // Seeds until every token's choice is clear of ties by far more than a step moves a logit.
  std::optional<MoE> moe;
  Tensor x;
  for (int attempt = 0; attempt < 64; ++attempt) {
    moe.emplace(moe_config(dim, ffn, 4, 2, GetParam()), Device::cpu(), fresh_seed(), DType::f32);
    x = testing::random_tensor({tokens, dim}, DType::f32, fresh_seed());
    if (clear_choices(*moe, x, 0.05)) break;
  }
  ASSERT_TRUE(clear_choices(*moe, x, 0.05)) << "no seed gave clear expert choices";
  randomize_activation_bias(*moe, fresh_seed());
  const Tensor g = testing::random_tensor({tokens, dim}, DType::f32, fresh_seed());
  const std::vector<float> gs = host(g);

  MoE::Saved saved;
  moe->forward(x, saved);
  const std::vector<float> dx = host(moe->backward(g, saved));
  const std::vector<float> dwr = host(moe->router_grad());

  auto check = [&](Tensor param, const std::vector<float>& analytic, const char* what) {
    std::vector<float> values = host(param);
    for (size_t i = 0; i < values.size(); i += 7) {  // a spread-out subset of the entries
      const float original = values[i];
      values[i] = original + kEps;
      param.copy_from(Tensor::from_vector(values, param.shape()));
      const double up = loss_of(*moe, x, gs);
      values[i] = original - kEps;
      param.copy_from(Tensor::from_vector(values, param.shape()));
      const double down = loss_of(*moe, x, gs);
      values[i] = original;
      param.copy_from(Tensor::from_vector(values, param.shape()));
      const double numeric = (up - down) / (2 * kEps);
      EXPECT_NEAR(analytic[i], numeric, 2e-3 + 2e-2 * std::abs(numeric)) << what << "[" << i << "]";
    }
  };
  check(x, dx, "dx");
  check(moe->router_weight(), dwr, "router dW");
}

INSTANTIATE_TEST_SUITE_P(All, MoEActivation,
                         ::testing::Values(ops::MoeActivation::swiglu, ops::MoeActivation::geglu,
                                           ops::MoeActivation::srelu, ops::MoeActivation::gelu),
                         [](const auto& info) { return ops::moe_activation_name(info.param); });

/// The bytes a step leaves in the layer: every gradient, the last dprob and every FP8 state.
std::vector<Tensor> layer_bytes(const MoE& moe) {
  std::vector<Tensor> out{moe.router_grad(), moe.activation_bias_grad(), moe.last_dprob()};
  for (const GroupedLinear* gl : {&moe.fc1(), &moe.fc2()}) {
    for (int64_t g = 0; g < gl->experts(); ++g) {
      const Linear& e = gl->expert(g);
      out.push_back(e.grad_weight());
      if (e.grad_bias().defined()) out.push_back(e.grad_bias());
      if (e.fp8_state())
        for (const Tensor& t : state_tensors(*e.fp8_state())) out.push_back(t);
    }
  }
  if (const MLP* shared = moe.shared()) {
    for (const Linear* l : {&shared->fc1(), &shared->fc2()}) {
      out.push_back(l->grad_weight());
      if (l->fp8_state())
        for (const Tensor& t : state_tensors(*l->fp8_state())) out.push_back(t);
    }
  }
  return out;
}

using Precision = std::optional<Recipe>;

/// One training step under the precision (FP8: an autocast scope, then the backward finalize);
/// returns y and dx.
std::pair<Tensor, Tensor> moe_step(MoE& moe, AmaxRegistry& registry, const Precision& p,
                                   const Tensor& x, const Tensor& dy) {
  MoE::Saved saved;
  Tensor y;
  if (p) {
    Fp8Autocast scope(*p, registry);
    y = moe.forward(x, saved);
  } else {
    y = moe.forward(x, saved);
  }
  Tensor dx = moe.backward(dy, saved);
  if (p) registry.finalize_backward();
  return {y, dx};
}

using Param = std::tuple<Device, Precision>;

class MoERecompute : public ::testing::TestWithParam<Param> {};

TEST_P(MoERecompute, BitwiseEqualToNoRecompute) {
  const auto& [device, precision] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const int64_t tokens = 48, dim = 64, ffn = 32;
  const uint64_t seed = fresh_seed();
  BlockConfig config = moe_config(dim, ffn, 4, 2, ops::MoeActivation::swiglu);
  config.moe.shared_expert = true;
  const DType compute = precision ? DType::f32 : DType::bf16;
  MoE plain(config, device, seed, compute, /*recompute=*/false);
  MoE recomputed(config, device, seed, compute, /*recompute=*/true);
  AmaxRegistry plain_registry, recompute_registry;
  // Two steps: under delayed scaling the second runs with calibrated scales.
  for (int step = 0; step < 2; ++step) {
    const Tensor x =
        testing::random_tensor({tokens, dim}, DType::bf16, seed + 11 + step).to(device);
    const Tensor dy =
        testing::random_tensor({tokens, dim}, DType::bf16, seed + 23 + step).to(device);
    const auto [y1, dx1] = moe_step(plain, plain_registry, precision, x, dy);
    const auto [y2, dx2] = moe_step(recomputed, recompute_registry, precision, x, dy);
    EXPECT_TRUE(bitwise_equal(y1, y2)) << "y, step " << step;
    EXPECT_TRUE(bitwise_equal(dx1, dx2)) << "dx, step " << step;
  }
  const std::vector<Tensor> a = layer_bytes(plain), b = layer_bytes(recomputed);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "tensor " << i;
}

INSTANTIATE_TEST_SUITE_P(
    All, MoERecompute,
    ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                       ::testing::Values(Precision{}, Precision{Recipe::delayed()})),
    [](const auto& info) {
      return testing::device_name(std::get<0>(info.param)) +
             (std::get<1>(info.param) ? "_fp8_delayed" : "_bf16");
    });

class MoEFusedCast : public ::testing::TestWithParam<Device> {};

/// Under delayed scaling the scaled activation writes FC2's FP8 input per expert (fusion
/// moe-activation-cast): every step, gradient and FP8 state bitwise those of the unfused path
/// (the activation, then each expert's own cast), with and without recompute.
TEST_P(MoEFusedCast, BitwiseEqualToUnfused) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const int64_t tokens = 40, dim = 32, ffn = 48;
  const uint64_t seed = fresh_seed();
  const BlockConfig config = moe_config(dim, ffn, 6, 2, ops::MoeActivation::swiglu);
  const Precision delayed{Recipe::delayed()};
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recompute" : "no recompute");
    MoE fused(config, device, seed, DType::f32, recompute);
    MoE unfused(config, device, seed, DType::f32, /*recompute=*/false);
    AmaxRegistry fused_registry, unfused_registry;
    // Step 0 calibrates the experts (the fused cast declines a first pass); 1 and 2 fuse.
    for (int step = 0; step < 3; ++step) {
      const Tensor x =
          testing::random_tensor({tokens, dim}, DType::bf16, seed + 11 + step).to(device);
      const Tensor dy =
          testing::random_tensor({tokens, dim}, DType::bf16, seed + 23 + step).to(device);
      if (step > 0) {
        Fp8Autocast scope(*delayed, fused_registry);
        for (int64_t g = 0; g < fused.experts(); ++g)
          ASSERT_TRUE(fused.fc2().expert(g).takes_fused_input(Linear::Saved{}))
              << "expert " << g << " would decline the fused cast at step " << step;
      }
      const auto [y1, dx1] = moe_step(fused, fused_registry, delayed, x, dy);
      std::pair<Tensor, Tensor> reference;
      {
        UnfusedScope off({Fusion::moe_activation_cast});
        reference = moe_step(unfused, unfused_registry, delayed, x, dy);
      }
      EXPECT_TRUE(bitwise_equal(y1, reference.first)) << "y, step " << step;
      EXPECT_TRUE(bitwise_equal(dx1, reference.second)) << "dx, step " << step;
    }
    const std::vector<Tensor> a = layer_bytes(fused), b = layer_bytes(unfused);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "tensor " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(All, MoEFusedCast, ::testing::ValuesIn(testing::all_backends()),
                         [](const auto& info) { return testing::device_name(info.param); });

TEST(MoE, EmptyExpertsGetNoGradient) {
  const int64_t tokens = 3, dim = 32, ffn = 16, experts = 8;
  MoE moe(moe_config(dim, ffn, experts, 1, ops::MoeActivation::srelu), Device::cpu(),
          fresh_seed(), DType::bf16);
  const Tensor x = testing::random_tensor({tokens, dim}, DType::bf16, fresh_seed());
  const Tensor dy = testing::random_tensor({tokens, dim}, DType::bf16, fresh_seed());
  AmaxRegistry registry;
  const auto [y, dx] = moe_step(moe, registry, Precision{}, x, dy);
  for (float v : host(y)) ASSERT_TRUE(std::isfinite(v));
  for (float v : host(dx)) ASSERT_TRUE(std::isfinite(v));
  const MoE::Load load = *moe.last_load();
  int empty = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (load.tokens[e] != 0) continue;
    ++empty;
    for (const GroupedLinear* gl : {&moe.fc1(), &moe.fc2()})
      for (float v : host(gl->expert(e).grad_weight())) ASSERT_EQ(v, 0.0f) << "expert " << e;
    const std::vector<float> dbias = host(moe.activation_bias_grad());
    for (int64_t j = 0; j < ffn; ++j) ASSERT_EQ(dbias[e * ffn + j], 0.0f) << "expert " << e;
  }
  EXPECT_GE(empty, experts - tokens) << "3 tokens with top-1 leave at least 5 experts empty";
}

// ----------------------------------------------------------------------------
// The field shape (FIELD-NOTES section 3): 16 experts x 1024 tokens each (8192 tokens, top-2),
// hidden 2048, ffn 2048, repeated byte for byte.

constexpr int64_t kFieldExperts = 16;
constexpr int64_t kFieldTopk = 2;
constexpr int64_t kFieldTokens = kFieldExperts * 1024 / kFieldTopk;
constexpr int64_t kFieldHidden = 2048;
/// Runs compared at the field shape. Each builds a fresh MoE (~200M weights drawn on the host,
/// most of a run's time), and float atomics at this shape differ on almost every run, so three
/// runs catch them; OCTET_TEST_REPEATS asks for more.
constexpr int kFieldRuns = 3;

/// Bytes of dx, dprob, dbias, every dW and every FP8 state after two steps from fixed inputs.
std::vector<std::vector<uint8_t>> field_run(const Precision& p, ops::MoeActivation act,
                                            uint64_t seed,
                                            const std::vector<std::pair<Tensor, Tensor>>& steps) {
  MoE moe(moe_config(kFieldHidden, kFieldHidden, kFieldExperts, kFieldTopk, act), Device::cuda(0),
          seed, p ? DType::f32 : DType::bf16);
  AmaxRegistry registry;
  std::vector<std::vector<uint8_t>> bytes;
  for (const auto& [x, dy] : steps) {
    const auto [y, dx] = moe_step(moe, registry, p, x, dy);
    for (const Tensor& t : {y, dx, moe.last_dprob()}) {
      const std::vector<float> values = host(t);
      EXPECT_TRUE(std::all_of(values.begin(), values.end(),
                              [](float v) { return std::isfinite(v); }))
          << "outputs are finite";
    }
    bytes.push_back(testing::to_bytes(dx));
  }
  for (const Tensor& t : layer_bytes(moe)) bytes.push_back(testing::to_bytes(t));
  return bytes;
}

using FieldParam = std::tuple<Precision, ops::MoeActivation>;
class MoERepeatability : public ::testing::TestWithParam<FieldParam> {};

TEST_P(MoERepeatability, FieldShapeRepeatsByteForByte) {
  OCTET_SKIP_IF_UNAVAILABLE(Device::cuda(0));
  if (testing::small_tests_only()) GTEST_SKIP() << "OCTET_TEST_SMALL: the field shape is large";
  const auto& [precision, act] = GetParam();
  const uint64_t seed = fresh_seed();
  const auto steps = testing::two_step_inputs(kFieldTokens, kFieldHidden, seed);
  const auto first = field_run(precision, act, seed, steps);
  const int runs = testing::repeats(kFieldRuns);
  int differing = 0;
  for (int r = 1; r < runs; ++r)
    if (field_run(precision, act, seed, steps) != first) ++differing;
  EXPECT_EQ(differing, 0) << differing << " of " << runs - 1
                          << " repeats differ from the first in dx, dprob, dbias, a dW or an "
                             "FP8 state";
}

INSTANTIATE_TEST_SUITE_P(
    Gpu, MoERepeatability,
    ::testing::Combine(::testing::Values(Precision{Recipe::delayed()}, Precision{}),
                       ::testing::Values(ops::MoeActivation::swiglu, ops::MoeActivation::srelu)),
    [](const auto& info) {
      return std::string(std::get<0>(info.param) ? "fp8_delayed_" : "bf16_") +
             ops::moe_activation_name(std::get<1>(info.param));
    });

}  // namespace
}  // namespace octet::nn
