// nn::Linear: finite-difference gradients in FP32; under every FP8 recipe, forward and backward
// track FP32, gradients accumulate over microbatches and the weight is cast once per step (or
// written by the optimizer); BF16 compute, bad inputs and placement across devices. Residual
// epilogues and fused FP8 casts are in linear_fusion_test.cc.
#include "octet/nn/linear.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <tuple>

#include "nn/nn_check.h"
#include "octet/nn/autocast.h"
#include "octet/ops/optimizer.h"
#include "test_util.h"

namespace octet::nn {
namespace {

using fp8::Recipe;
using testing::all_recipes;
using testing::device_name;
using testing::fresh_seed;
using ::testing::HasSubstr;
using testing::to_floats;

// ----------------------------------------------------------------------------
// FP32: finite-difference gradients

struct FdShape {
  Shape x;  ///< [..., in]
  int64_t out;
  bool bias;
};

using FdParam = std::tuple<Device, FdShape>;
class LinearGradientTest : public ::testing::TestWithParam<FdParam> {};

/// loss = sum(y * g) in float64, so dloss/dy = g.
double loss(Linear& layer, const Tensor& x, const std::vector<float>& g) {
  Linear::Saved saved;
  const std::vector<float> y = to_floats(layer.forward(x, saved));
  double sum = 0;
  for (size_t i = 0; i < y.size(); ++i) sum += double(y[i]) * g[i];
  return sum;
}

/// Sets element i of the f32 tensor t (any device) to v; returns the value it held.
float exchange(const Tensor& t, int64_t i, float v) {
  std::vector<float> values = to_floats(t);
  const float old = values[i];
  values[i] = v;
  Tensor(t).copy_from(Tensor::from_vector(values, t.shape()));
  return old;
}

/// Central difference of loss over element i of t, in float64. The step is the one actually
/// stored (fl(t_i +- h) - t_i), so rounding of the perturbed parameter adds no error. The loss is
/// linear in every parameter, so the difference quotient is exact up to the rounding of y.
double central_difference(Linear& layer, const Tensor& x, const std::vector<float>& g,
                          const Tensor& t, int64_t i) {
  constexpr float kStep = 1.0f / 64;
  const float center = to_floats(t)[i];
  const float plus = center + kStep, minus = center - kStep;
  exchange(t, i, plus);
  layer.on_weights_updated();
  const double loss_plus = loss(layer, x, g);
  exchange(t, i, minus);
  layer.on_weights_updated();
  const double loss_minus = loss(layer, x, g);
  exchange(t, i, center);
  layer.on_weights_updated();
  return (loss_plus - loss_minus) / (double(plus) - double(minus));
}

/// |analytic - numeric| <= kAbs + kRel |numeric|: the rounding of y (float, |y| ~ 1) divided by
/// the step 2/64 stays far below these.
constexpr double kFdAbs = 5e-4;
constexpr double kFdRel = 1e-3;

TEST_P(LinearGradientTest, MatchesCentralDifferences) {
  const auto& [device, shape] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t in = shape.x.back();
  Linear layer(in, shape.out, shape.bias, device, seed);
  Tensor x = testing::random_tensor(shape.x, DType::f32, seed + 1).to(device);
  Shape y_shape = shape.x;
  y_shape.back() = shape.out;
  Tensor g = testing::random_tensor(y_shape, DType::f32, seed + 2).to(device);
  const std::vector<float> gs = to_floats(g);

  Linear::Saved saved;
  layer.forward(x, saved);
  const Tensor dx = layer.backward(g, saved);
  EXPECT_EQ(dx.shape(), shape.x);
  EXPECT_EQ(dx.device(), device);

  auto check = [&](const Tensor& param, const Tensor& analytic, const char* what) {
    const std::vector<float> a = to_floats(analytic);
    for (int64_t i = 0; i < param.numel(); ++i) {
      const double numeric = central_difference(layer, x, gs, param, i);
      ASSERT_NEAR(a[i], numeric, kFdAbs + kFdRel * std::fabs(numeric)) << what << "[" << i << "]";
    }
  };
  check(x, dx, "dx");
  check(layer.weight(), layer.grad_weight(), "dW");
  if (shape.bias) {
    check(layer.bias(), layer.grad_bias(), "db");
  } else {
    EXPECT_FALSE(layer.grad_bias().defined());
  }
}

std::string fd_param_name(const ::testing::TestParamInfo<FdParam>& info) {
  const Device& device = std::get<0>(info.param);
  const FdShape& shape = std::get<1>(info.param);
  return device_name(device) + "_" + std::to_string(shape_numel(shape.x)) + "x" +
         std::to_string(shape.out) + (shape.bias ? "_bias" : "_nobias");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LinearGradientTest,
    ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                       ::testing::Values(FdShape{{4, 5}, 3, true}, FdShape{{2, 3, 7}, 4, true},
                                         FdShape{{3, 6}, 2, false}, FdShape{{1, 1}, 1, true})),
    fd_param_name);

// ----------------------------------------------------------------------------
// FP8 against FP32

/// Error metrics against the FP32 reference, on values of unit scale: everything is divided by
/// the reference's RMS first, so the bounds hold whatever the layer's gain.
///   rel_l2 = ||a - r|| / ||r||                  (the typical error)
///   max_err = max_i |a_i - r_i| / rms(r)        (the worst element)
/// An elementwise atol + rtol|r| bound does not fit FP8 GEMMs: the error of an output element
/// comes from rounding its K operand pairs, so it does not shrink with |r|. Measured on
/// [160 x 192] x [192 x 144] with uniform unit inputs: E4M3 operands give rel_l2 0.035-0.036 and
/// max_err up to 0.17; an E5M2 gradient operand (HYBRID dgrad/wgrad) gives rel_l2 0.057 and
/// max_err up to 0.27. The bounds below are about twice the typical error and about 7 standard
/// deviations for the worst of ~30k elements.
struct Tolerance {
  double rel_l2, max_err;
};

/// Outputs of E4M3 x E4M3 GEMMs (3 mantissa bits: relative rounding up to 2^-4 per operand).
constexpr Tolerance kE4M3Tol{0.0675, 0.25};
/// Outputs of E5M2 x E4M3 GEMMs (HYBRID gradients: 2 mantissa bits in one operand).
constexpr Tolerance kE5M2Tol{0.125, 0.4};

::testing::AssertionResult within(const Tensor& actual, const Tensor& reference,
                                  const Tolerance& tol) {
  const std::vector<float> a = to_floats(actual), r = to_floats(reference);
  double ss = 0;
  for (float v : r) ss += double(v) * v;
  const double rms = std::sqrt(ss / r.size());
  if (!(rms > 0)) return ::testing::AssertionFailure() << "reference is all zero";
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]))
      return ::testing::AssertionFailure() << "element " << i << " is " << a[i];
    const double err = std::fabs(a[i] - r[i]) / rms;
    if (err > tol.max_err)
      return ::testing::AssertionFailure()
             << "element " << i << ": " << a[i] << " vs reference " << r[i] << " (rms " << rms
             << "): error " << err << " rms > " << tol.max_err;
  }
  const double l2 = testing::relative_l2(a, r);
  if (l2 > tol.rel_l2)
    return ::testing::AssertionFailure() << "relative L2 error " << l2 << " > " << tol.rel_l2;
  return ::testing::AssertionSuccess() << "relative L2 error " << l2;
}

using Fp8Param = std::tuple<Device, Recipe>;
class LinearFp8Test : public ::testing::TestWithParam<Fp8Param> {};

std::string fp8_param_name(const ::testing::TestParamInfo<Fp8Param>& info) {
  const auto& [device, recipe] = info.param;
  std::string name = device_name(device) + "_" + recipe.name();
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

/// One microbatch: forward under autocast (finalized at scope exit), backward, finalize.
Tensor run_microbatch(Linear& layer, const Recipe& recipe, AmaxRegistry& registry, const Tensor& x,
                      const Tensor& dy, Tensor* y_out = nullptr) {
  Linear::Saved saved;
  Tensor y;
  {
    Fp8Autocast scope(recipe, registry);
    y = layer.forward(x, saved);
  }
  Tensor dx = layer.backward(dy, saved);
  registry.finalize_backward();
  if (y_out) *y_out = y;
  return dx;
}

/// Inputs and output gradients of two microbatches of `tokens` rows, drawn from `seed`.
std::pair<std::array<Tensor, 2>, std::array<Tensor, 2>> two_microbatches(int64_t in, int64_t out,
                                                                         int64_t tokens,
                                                                         const Device& device,
                                                                         uint64_t seed) {
  std::array<Tensor, 2> x, dy;
  for (int m = 0; m < 2; ++m) {
    x[m] = testing::random_tensor({tokens, in}, DType::f32, seed + 1 + 2 * m).to(device);
    dy[m] = testing::random_tensor({tokens, out}, DType::f32, seed + 2 + 2 * m).to(device);
  }
  return {x, dy};
}

TEST_P(LinearFp8Test, ForwardAndBackwardTrackFp32) {
  const auto& [device, recipe] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Multiples of 16 (the FP8 GEMM rule) that leave partial 128-wide blocks.
  const int64_t in = 192, out = 144;
  const Shape x_shape{2, 80, in}, y_shape{2, 80, out};
  Linear fp8_layer(in, out, true, device, seed);
  Linear reference(in, out, true, device, seed);
  Tensor x = testing::random_tensor(x_shape, DType::f32, seed + 1).to(device);
  Tensor dy = testing::random_tensor(y_shape, DType::f32, seed + 2).to(device);

  AmaxRegistry registry;
  if (recipe.kind == fp8::RecipeKind::delayed) {
    // Calibrate: the first pass runs at scale 1; the measured one uses the amaxes it recorded.
    run_microbatch(fp8_layer, recipe, registry, x, dy);
    fp8_layer.zero_grad();
    fp8_layer.on_weights_updated();
  }
  Tensor y;
  const Tensor dx = run_microbatch(fp8_layer, recipe, registry, x, dy, &y);

  Linear::Saved saved;
  const Tensor y_ref = reference.forward(x, saved);
  const Tensor dx_ref = reference.backward(dy, saved);

  const bool hybrid = recipe.format == fp8::Fp8Format::hybrid;
  EXPECT_TRUE(within(y, y_ref, kE4M3Tol)) << "y";
  EXPECT_TRUE(within(dx, dx_ref, hybrid ? kE5M2Tol : kE4M3Tol)) << "dx";
  EXPECT_TRUE(
      within(fp8_layer.grad_weight(), reference.grad_weight(), hybrid ? kE5M2Tol : kE4M3Tol))
      << "dW";
  // The bias gradient is summed from the high-precision dy: exact to FP32 rounding.
  EXPECT_TRUE(testing::bitwise_equal(reference.grad_bias(), fp8_layer.grad_bias()));
}

TEST_P(LinearFp8Test, GradientsAccumulateOverMicrobatches) {
  const auto& [device, recipe] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t in = 48, out = 32, tokens = 16;
  const auto [x, dy] = two_microbatches(in, out, tokens, device, seed);
  // Accumulated: both microbatches into one gradient.
  Linear accumulated(in, out, true, device, seed);
  AmaxRegistry registry_a;
  for (int m = 0; m < 2; ++m) run_microbatch(accumulated, recipe, registry_a, x[m], dy[m]);
  // Separate: the same sequence (so delayed scales evolve identically), gradients read apart.
  Linear separate(in, out, true, device, seed);
  AmaxRegistry registry_s;
  std::vector<float> sum_w(in * out, 0.0f), sum_b(out, 0.0f);
  for (int m = 0; m < 2; ++m) {
    separate.zero_grad();
    run_microbatch(separate, recipe, registry_s, x[m], dy[m]);
    const std::vector<float> gw = to_floats(separate.grad_weight());
    const std::vector<float> gb = to_floats(separate.grad_bias());
    for (size_t i = 0; i < gw.size(); ++i) sum_w[i] += gw[i];
    for (size_t i = 0; i < gb.size(); ++i) sum_b[i] += gb[i];
  }
  // (0 + g1) + g2 and g1 + g2 round alike; allow one rounding of the GEMM's beta epilogue.
  const std::vector<float> acc_w = to_floats(accumulated.grad_weight());
  for (size_t i = 0; i < acc_w.size(); ++i)
    ASSERT_NEAR(acc_w[i], sum_w[i], 1e-6 * (std::fabs(sum_w[i]) + 1e-3)) << "dW[" << i << "]";
  EXPECT_TRUE(testing::bitwise_equal(Tensor::from_vector(sum_b, {out}), accumulated.grad_bias()));
  EXPECT_FALSE(
      testing::bitwise_equal(Tensor::from_vector(sum_w, {out, in}), separate.grad_weight()))
      << "the second microbatch alone must differ from the sum";
}

TEST_P(LinearFp8Test, WeightIsCastOncePerStepAndReusedAcrossMicrobatches) {
  const auto& [device, recipe] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Linear layer(32, 32, true, device, seed);
  AmaxRegistry registry;
  std::vector<Linear::Saved> saved(3);
  std::vector<uint8_t> scale_inv_bytes;
  for (int m = 0; m < 3; ++m) {
    Tensor x = testing::random_tensor({16, 32}, DType::f32, seed + 1 + m).to(device);
    {
      Fp8Autocast scope(recipe, registry);
      layer.forward(x, saved[m]);
    }
    EXPECT_EQ(layer.weight_casts(), 1) << "microbatch " << m;
    EXPECT_EQ(saved[m].snapshot.weight, saved[0].snapshot.weight) << "microbatch " << m;
    // The cast owns its scales: the finalizes in between do not reach it.
    std::vector<uint8_t> bytes = testing::to_bytes(saved[m].snapshot.weight->q.scale_inv);
    if (m == 0) scale_inv_bytes = bytes;
    EXPECT_EQ(bytes, scale_inv_bytes) << "microbatch " << m;
  }
  // The optimizer steps twice, doubling the weight each time; each step casts it once.
  Linear::Saved next;
  for (int step = 1; step <= 2; ++step) {
    std::vector<float> w = testing::to_floats(layer.weight());
    for (float& v : w) v *= 2.0f;
    Tensor(layer.weight()).copy_from(Tensor::from_vector(w, {32, 32}).to(device));
    layer.on_weights_updated();
    Fp8Autocast scope(recipe, registry);
    layer.forward(testing::random_tensor({16, 32}, DType::f32, seed + step).to(device), next);
    EXPECT_NE(next.snapshot.weight, saved[0].snapshot.weight);
    EXPECT_EQ(layer.weight_casts(), 1 + step);
  }
  if (recipe.kind == fp8::RecipeKind::delayed) {
    // The last cast used the scale learned from the doubled weight's amax (the first cast's own
    // amax gave the step after it the same scale it had), and the first cast still holds its own.
    EXPECT_NE(testing::to_bytes(saved[0].snapshot.weight->q.scale_inv),
              testing::to_bytes(next.snapshot.weight->q.scale_inv));
    EXPECT_EQ(testing::to_bytes(saved[0].snapshot.weight->q.scale_inv), scale_inv_bytes);
  }
}

/// One AdamW step of `layer`'s weight and bias that also writes `cast`'s prepared fields (none
/// when it is empty), then on_weights_updated (written when anything was prepared).
void step_adamw(Linear& layer, const Linear::NextCast& cast) {
  const Device& device = layer.device();
  const auto zeros = [&](const Tensor& t) { return Tensor::zeros(t.shape(), DType::f32, device); };
  std::vector<ops::AdamWTensor> table = {
      {layer.weight(), layer.grad_weight(), zeros(layer.weight()), zeros(layer.weight()), 0.1f,
       cast.weight_fp8, cast.weight_bf16},
      {layer.bias(), layer.grad_bias(), zeros(layer.bias()), zeros(layer.bias()), 0.0f, nullptr,
       cast.bias_bf16}};
  const Tensor norm_sq = Tensor::from_vector({1.0f}, {1}).to(device);
  ops::adamw_step(table.data(), static_cast<int>(table.size()), norm_sq, ops::AdamWArgs{});
  const bool prepared = cast.weight_fp8 != nullptr || cast.weight_bf16.defined();
  layer.on_weights_updated(prepared ? PreparedCast::written : PreparedCast::dropped);
  layer.zero_grad();
}

TEST_P(LinearFp8Test, WeightCastWrittenByTheOptimizerEqualsCastingAgain) {
  const auto& [device, recipe] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t in = 192, out = 144, tokens = 80;  // partial 64-byte transpose tiles
  const auto [x, dy] = two_microbatches(in, out, tokens, device, seed);
  // Two equal layers take one step each: `adopted` lets AdamW write its next weight cast,
  // `recast` casts the updated master at its next forward, as before.
  Linear adopted(in, out, true, device, seed), recast(in, out, true, device, seed);
  AmaxRegistry registry_a, registry_r;
  run_microbatch(adopted, recipe, registry_a, x[0], dy[0]);
  run_microbatch(recast, recipe, registry_r, x[0], dy[0]);
  const Linear::NextCast cast = adopted.prepare_next_cast();
  const bool offered = cast.weight_fp8 != nullptr;
  EXPECT_EQ(offered, recipe.kind == fp8::RecipeKind::delayed)
      << "offered exactly for delayed (per-tensor, stored-scale) recipes";
  EXPECT_EQ(cast.bias_bf16.defined(), offered) << "the bias copy comes with the weight cast";
  EXPECT_FALSE(cast.weight_bf16.defined()) << "an FP8 layer has no dense copy";
  step_adamw(adopted, cast);
  step_adamw(recast, Linear::NextCast{});
  Tensor y_a, y_r;
  const Tensor dx_a = run_microbatch(adopted, recipe, registry_a, x[1], dy[1], &y_a);
  const Tensor dx_r = run_microbatch(recast, recipe, registry_r, x[1], dy[1], &y_r);
  EXPECT_TRUE(testing::bitwise_equal(y_a, y_r)) << "y";
  EXPECT_TRUE(testing::bitwise_equal(dx_a, dx_r)) << "dx";
  EXPECT_TRUE(testing::bitwise_equal(adopted.grad_weight(), recast.grad_weight())) << "dW";
  EXPECT_TRUE(testing::bitwise_equal(adopted.grad_bias(), recast.grad_bias())) << "db";
  EXPECT_EQ(adopted.weight_casts(), 2);
  EXPECT_EQ(recast.weight_casts(), 2);
  // A prepared cast that the optimizer did not write is never adopted.
  if (recast.prepare_next_cast().weight_fp8 != nullptr) {
    recast.on_weights_updated();
    run_microbatch(recast, recipe, registry_r, x[1], dy[1]);
    EXPECT_EQ(recast.weight_casts(), 3) << "dropped: the forward cast the weight itself";
  }
  for (const fp8::TensorRole role : {fp8::TensorRole::input, fp8::TensorRole::weight}) {
    EXPECT_TRUE(
        testing::bitwise_equal(adopted.fp8_state()->scale(role), recast.fp8_state()->scale(role)))
        << "the FP8 state's scales evolve alike";
  }
}

// Each step the optimizer writes the next cast into the last one's memory when nothing else
// holds it, and into new memory while a record of a forward without its backward does; either
// way the layer computes bitwise as one that casts its master again at each forward.
TEST_P(LinearFp8Test, NextCastTakesTheLastCastsMemoryUnlessARecordHoldsIt) {
  const auto& [device, recipe] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  if (!Linear::optimizer_writes_cast(WeightCast::Key::fp8_weight(recipe)))
    GTEST_SKIP() << "this recipe casts at each forward: the optimizer writes no cast";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t in = 64, out = 48, tokens = 32;
  Linear adopted(in, out, true, device, seed), recast(in, out, true, device, seed);
  AmaxRegistry registry_a, registry_r;
  const void* last = nullptr;
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto [x, dy] = two_microbatches(in, out, tokens, device, seed + 10 * step);
    Tensor y_a, y_r;
    const Tensor dx_a = run_microbatch(adopted, recipe, registry_a, x[0], dy[0], &y_a);
    const Tensor dx_r = run_microbatch(recast, recipe, registry_r, x[0], dy[0], &y_r);
    EXPECT_TRUE(testing::bitwise_equal(y_a, y_r)) << "y";
    EXPECT_TRUE(testing::bitwise_equal(dx_a, dx_r)) << "dx";
    if (step == 3) break;
    // At step 2 both layers keep the record of a forward whose backward never runs.
    Linear::Saved held_a, held_r;
    if (step == 2) {
      Fp8Autocast scope_a(recipe, registry_a);
      adopted.forward(x[1], held_a);
      Fp8Autocast scope_r(recipe, registry_r);
      recast.forward(x[1], held_r);
    }
    const Linear::NextCast cast = adopted.prepare_next_cast();
    ASSERT_NE(cast.weight_fp8, nullptr);
    const void* memory = cast.weight_fp8->out->data.raw_data();
    if (step == 1) EXPECT_EQ(memory, last) << "nothing held the last cast: its memory is reused";
    if (step == 2) EXPECT_NE(memory, last) << "a record holds the last cast: new memory";
    last = memory;
    step_adamw(adopted, cast);
    step_adamw(recast, Linear::NextCast{});
  }
}

// ZeRO-1's rank that does not own a weight: it frees the master and computes from the casts the
// owner's optimizer wrote, received as bytes; a skipped step (a dropped update) keeps them.
TEST_P(LinearFp8Test, WithoutItsMasterALayerComputesFromTheCastsWrittenForIt) {
  const auto& [device, recipe] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t in = 64, out = 48, tokens = 32;
  const auto [x, dy] = two_microbatches(in, out, tokens, device, seed);
  Linear owner(in, out, true, device, seed), other(in, out, true, device, seed);
  AmaxRegistry registry_o, registry_x;
  run_microbatch(owner, recipe, registry_o, x[0], dy[0]);
  run_microbatch(other, recipe, registry_x, x[0], dy[0]);
  const Linear::NextCast sent = owner.prepare_next_cast();
  const Linear::NextCast received = other.prepare_next_cast();
  EXPECT_EQ(sent.weight_fp8 != nullptr,
            Linear::optimizer_writes_cast(WeightCast::Key::fp8_weight(recipe)));
  if (sent.weight_fp8 == nullptr) {
    // This recipe casts from the master at each forward: without it there is nothing to use.
    other.release_master_weight();
    other.on_weights_updated();
    EXPECT_NE(testing::error_of([&] {
                run_microbatch(other, recipe, registry_x, x[1], dy[1]);
              }).find("its FP32 master weight was released"),
              std::string::npos);
    return;
  }
  step_adamw(owner, sent);
  const fp8::QuantizedTensor& q = *sent.weight_fp8->out;
  const fp8::QuantizedTensor& mine = *received.weight_fp8->out;
  for (const auto& [from, to] : {std::pair{&q.data, &mine.data},
                                 {&q.scale_inv, &mine.scale_inv},
                                 {&q.data_t, &mine.data_t},
                                 {&q.scale_inv_t, &mine.scale_inv_t},
                                 {&sent.weight_fp8->args.amax, &received.weight_fp8->args.amax},
                                 {&sent.bias_bf16, &received.bias_bf16}})
    if (from->defined()) Tensor(*to).copy_from(*from);
  Tensor(other.bias()).copy_from(owner.bias());  // the bias stays whole: its value is sent
  other.release_master_weight();
  EXPECT_FALSE(other.weight().defined());
  other.on_weights_updated(PreparedCast::written);
  other.zero_grad();
  other.on_weights_updated(PreparedCast::dropped);  // a skipped step: the cast stays
  owner.on_weights_updated(PreparedCast::dropped);  // the owner recasts the same bytes
  Tensor y_o, y_x;
  const Tensor dx_o = run_microbatch(owner, recipe, registry_o, x[1], dy[1], &y_o);
  const Tensor dx_x = run_microbatch(other, recipe, registry_x, x[1], dy[1], &y_x);
  EXPECT_TRUE(testing::bitwise_equal(y_x, y_o)) << "y";
  EXPECT_TRUE(testing::bitwise_equal(dx_x, dx_o)) << "dx";
  EXPECT_TRUE(testing::bitwise_equal(other.grad_weight(), owner.grad_weight())) << "dW";
}

TEST_P(LinearFp8Test, ZeroGradOnNextWriteEqualsZeroingFirst) {
  const auto& [device, recipe] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t in = 48, out = 32, tokens = 16;
  const auto [x, dy] = two_microbatches(in, out, tokens, device, seed);
  // Two layers on the same sequence: a first step leaves gradients behind, then a step of two
  // microbatches starts from zero_grad(now) in one and zero_grad(on_next_write) in the other.
  Linear zeroed(in, out, true, device, seed), overwritten(in, out, true, device, seed);
  AmaxRegistry registry_z, registry_o;
  run_microbatch(zeroed, recipe, registry_z, x[1], dy[1]);
  run_microbatch(overwritten, recipe, registry_o, x[1], dy[1]);
  zeroed.zero_grad(ZeroGrad::now);
  overwritten.zero_grad(ZeroGrad::on_next_write);
  for (int m = 0; m < 2; ++m) {
    run_microbatch(zeroed, recipe, registry_z, x[m], dy[m]);
    run_microbatch(overwritten, recipe, registry_o, x[m], dy[m]);
  }
  // The first GEMM writes dW where the other adds it to zeros: equal values (an exact zero may
  // differ in sign, which compares equal).
  const std::vector<float> want = to_floats(zeroed.grad_weight());
  const std::vector<float> got = to_floats(overwritten.grad_weight());
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(want[i], got[i]) << "dW[" << i << "]";
  EXPECT_TRUE(testing::bitwise_equal(zeroed.grad_bias(), overwritten.grad_bias()));
  // settle_grad() leaves a written gradient alone, and zeroes one that no backward wrote.
  overwritten.settle_grad();
  EXPECT_EQ(to_floats(overwritten.grad_weight()), got);
  overwritten.zero_grad(ZeroGrad::on_next_write);
  overwritten.settle_grad();
  for (float v : to_floats(overwritten.grad_weight())) ASSERT_EQ(v, 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Recipes, LinearFp8Test,
                         ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                                            ::testing::ValuesIn(all_recipes())),
                         fp8_param_name);

// ----------------------------------------------------------------------------
// High precision, errors, placement

class LinearBackendTest : public ::testing::TestWithParam<Device> {};

TEST_P(LinearBackendTest, Bf16ComputeTracksFp32AndCastsOncePerStep) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Linear bf16(40, 24, true, device, seed, DType::bf16);
  Linear f32(40, 24, true, device, seed, DType::f32);
  Tensor x = testing::random_tensor({3, 5, 40}, DType::bf16, seed + 1).to(device);
  Tensor dy = testing::random_tensor({3, 5, 24}, DType::bf16, seed + 2).to(device);
  Linear::Saved s1, s2;
  Tensor y = bf16.forward(x, s1);
  EXPECT_EQ(y.dtype(), DType::bf16);
  EXPECT_EQ(y.shape(), (Shape{3, 5, 24}));
  Tensor dx = bf16.backward(dy, s1);
  EXPECT_EQ(dx.dtype(), DType::bf16);
  bf16.forward(x, s2);
  EXPECT_EQ(bf16.weight_casts(), 1);
  EXPECT_EQ(s2.snapshot.weight->dense.dtype(), DType::bf16);

  Tensor x32 = Tensor::empty(x.shape(), DType::f32, device);
  x32.copy_from(Tensor::from_vector(to_floats(x), x.shape()).to(device));
  Tensor dy32 = Tensor::from_vector(to_floats(dy), dy.shape()).to(device);
  Linear::Saved s32;
  Tensor y32 = f32.forward(x32, s32);
  Tensor dx32 = f32.backward(dy32, s32);
  // bf16 weights (8 significant bits: 2^-9 relative rounding) and a bf16 output; measured
  // rel_l2 0.0024 and max_err up to 0.012 (the inputs are the same values in both runs).
  constexpr Tolerance kBf16Tol{0.005, 0.025};
  EXPECT_TRUE(within(y, y32, kBf16Tol));
  EXPECT_TRUE(within(dx, dx32, kBf16Tol));
  EXPECT_TRUE(within(bf16.grad_weight(), f32.grad_weight(), kBf16Tol));
}

/// A bf16-compute layer whose optimizer wrote the bf16 weight and bias copies computes bitwise as
/// one that casts its updated masters at the next forward.
TEST_P(LinearBackendTest, Bf16CopiesWrittenByTheOptimizerEqualCastingAgain) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Linear adopted(48, 32, true, device, seed, DType::bf16);
  Linear recast(48, 32, true, device, seed, DType::bf16);
  const Tensor x = testing::random_tensor({20, 48}, DType::bf16, seed + 1).to(device);
  const Tensor dy = testing::random_tensor({20, 32}, DType::bf16, seed + 2).to(device);
  for (Linear* layer : {&adopted, &recast}) {
    Linear::Saved saved;
    layer->forward(x, saved);
    layer->backward(dy, saved);
  }
  const Linear::NextCast cast = adopted.prepare_next_cast();
  ASSERT_TRUE(cast.weight_bf16.defined() && cast.bias_bf16.defined());
  EXPECT_EQ(cast.weight_fp8, nullptr);
  step_adamw(adopted, cast);
  step_adamw(recast, Linear::NextCast{});
  Linear::Saved saved_a, saved_r;
  const Tensor y_a = adopted.forward(x, saved_a), y_r = recast.forward(x, saved_r);
  EXPECT_TRUE(testing::bitwise_equal(y_a, y_r)) << "y";
  EXPECT_TRUE(
      testing::bitwise_equal(saved_a.snapshot.weight->dense, saved_r.snapshot.weight->dense))
      << "the bf16 weight";
  EXPECT_TRUE(testing::bitwise_equal(adopted.backward(dy, saved_a), recast.backward(dy, saved_r)))
      << "dx";
  EXPECT_EQ(adopted.weight_casts(), 2);
  EXPECT_EQ(recast.weight_casts(), 2);
}

TEST_P(LinearBackendTest, RejectsInputsThatDoNotFit) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  Linear layer(8, 4, true, device, fresh_seed());
  Linear::Saved saved;
  EXPECT_THAT(
      [&] {
        layer.forward(Tensor::zeros({3, 7}, DType::f32, device), saved);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("expects input [..., 8], got f32[3, 7]")));
  EXPECT_THAT(
      [&] {
        layer.forward(Tensor::zeros({3, 8}, DType::i32, device), saved);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("must be f32 or bf16, got i32[3, 8]")));
  EXPECT_THAT(
      [&] {
        layer.backward(Tensor::zeros({3, 4}, DType::f32, device), saved);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("needs the Saved of a forward")));
  layer.forward(Tensor::zeros({3, 8}, DType::f32, device), saved);
  EXPECT_THAT(
      [&] {
        layer.backward(Tensor::zeros({2, 4}, DType::f32, device), saved);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("expects grad_output of shape [3, 4]")));
  Linear::Saved empty;
  EXPECT_THAT(
      [&] {
        layer.forward(Tensor::zeros({3, 8}, DType::f32, device), empty, ForwardMode::recompute);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("needs the snapshot")));
}

TEST_P(LinearBackendTest, Fp8DimensionsNotMultipleOf16SurfaceTheGemmError) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  Linear layer(24, 16, true, device, fresh_seed());
  AmaxRegistry registry;
  Linear::Saved saved;
  Tensor x = testing::random_tensor({16, 24}, DType::f32, fresh_seed()).to(device);
  EXPECT_THAT(
      [&] {
        Fp8Autocast scope(Recipe::current(), registry);
        layer.forward(x, saved);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("16")));
  EXPECT_EQ(registry.forward_update_count(), 0);  // the failed pass was not finalized
}

INSTANTIATE_TEST_SUITE_P(Backends, LinearBackendTest, ::testing::ValuesIn(testing::all_backends()),
                         [](const auto& info) { return device_name(info.param); });

TEST(LinearPlacement, InputOnAnotherDeviceIsRejectedWithBothDevicesNamed) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  Linear on_cpu(8, 4, true, Device::cpu(), fresh_seed());
  Linear::Saved saved;
  EXPECT_THAT(
      [&] {
        on_cpu.forward(Tensor::zeros({2, 8}, DType::f32, Device::cuda(0)), saved);
      },
      ::testing::ThrowsMessage<Error>(
          HasSubstr("lives on cpu but its input is f32[2, 8] on cuda:0; move the input to cpu")));
  Linear on_gpu(8, 4, true, Device::cuda(0), fresh_seed());
  on_gpu.forward(Tensor::zeros({2, 8}, DType::f32, Device::cuda(0)), saved);
  EXPECT_THAT(
      [&] {
        on_gpu.backward(Tensor::zeros({2, 4}, DType::f32), saved);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("its grad_output is f32[2, 4] on cpu")));
}

TEST(LinearPlacement, TwoGpusUnderOneAutocastKeepStateOnTheirOwnDevice) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Linear on1(32, 32, true, Device::cuda(1), seed);
  Linear on0(32, 32, true, Device::cuda(0), seed + 1);
  AmaxRegistry registry;
  Linear::Saved s1, s0;
  Tensor y;
  {
    Fp8Autocast scope(Recipe::delayed(), registry);
    Tensor h =
        on1.forward(testing::random_tensor({16, 32}, DType::f32, seed).to(Device::cuda(1)), s1);
    y = on0.forward(h.to(Device::cuda(0)), s0);
  }
  EXPECT_EQ(y.device(), Device::cuda(0));
  for (const Linear* l : {&on1, &on0}) {
    const FP8State& state = *l->fp8_state();
    EXPECT_EQ(state.device(), l->device());
    EXPECT_EQ(state.group(Pass::forward).amax_history.device(), l->device());
    EXPECT_EQ(state.group(Pass::backward).scale.device(), l->device());
    EXPECT_EQ(state.forward_updates(), 1);
  }
  EXPECT_EQ(registry.scaling_update_calls(), 2);  // one per device
  Tensor g =
      on0.backward(testing::random_tensor({16, 32}, DType::f32, seed + 2).to(Device::cuda(0)), s0);
  on1.backward(g.to(Device::cuda(1)), s1);
  registry.finalize_backward();
  EXPECT_EQ(registry.scaling_update_calls(), 4);
  EXPECT_EQ(on1.fp8_state()->backward_updates(), 1);
}

}  // namespace
}  // namespace octet::nn
