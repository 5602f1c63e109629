// nn::Linear's fusions: a residual added in the GEMM's epilogue equals the forward then an add
// (and recomputes bitwise), and an FP8 input or grad_output written by its producer (a norm, an
// activation) under delayed scaling is bitwise the unfused layer's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "nn/nn_check.h"
#include "octet/nn/autocast.h"
#include "octet/nn/linear.h"
#include "octet/ops/activation.h"
#include "octet/ops/norm.h"
#include "octet/ops/quantize.h"
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
// A residual added in the GEMM's epilogue (Linear::forward's `residual`)

/// A Linear's precision: dense in its compute dtype, or FP8 under a recipe; and the dtype of the
/// activations (input, output, residual).
struct ResidualPrecision {
  std::string name;
  DType activation;
  DType compute;
  std::optional<Recipe> recipe;
};

void PrintTo(const ResidualPrecision& p, std::ostream* out) { *out << p.name; }

std::vector<ResidualPrecision> residual_precisions() {
  std::vector<ResidualPrecision> out = {{"fp32", DType::f32, DType::f32, std::nullopt},
                                        {"bf16", DType::bf16, DType::bf16, std::nullopt}};
  for (const Recipe& recipe : all_recipes()) {
    for (DType activation : {DType::f32, DType::bf16}) {
      std::string name = recipe.name() + "_" + std::string(dtype_name(activation));
      std::replace(name.begin(), name.end(), '-', '_');
      out.push_back({name, activation, DType::f32, recipe});
    }
  }
  return out;
}

using ResidualParam = std::tuple<Device, ResidualPrecision>;
class LinearResidualTest : public ::testing::TestWithParam<ResidualParam> {};

/// CUDA GEMMs against the reference (docs/NUMERICS.md): FP8 fast accumulation (2^-9), dense f32 or
/// bf16 operands (1e-5); and one BF16 rounding of an output, 2^-8 relative at most.
constexpr double kFastAccumulationRelL2 = 0.001953125;
constexpr double kDenseGemmRelL2 = 1e-5;
constexpr double kBf16RoundingRelL2 = 0.00390625;

/// Multiples of 16 (FP8) with a partial 128-row tile.
constexpr int64_t kResidualTokens = 48, kResidualIn = 64, kResidualOut = 80;
const Shape kResidualX{2, kResidualTokens, kResidualIn};
const Shape kResidualY{2, kResidualTokens, kResidualOut};

/// y = layer(x) (+ residual) in a training forward, under the precision's autocast if any.
Tensor residual_forward(Linear& layer, const ResidualPrecision& p, AmaxRegistry& registry,
                        const Tensor& x, Linear::Saved& saved, const Tensor& residual) {
  if (!p.recipe) return layer.forward(x, saved, ForwardMode::normal, residual);
  Fp8Autocast scope(*p.recipe, registry);
  return layer.forward(x, saved, ForwardMode::normal, residual);
}

/// The spacing of `dtype` values at |x| (f32: 2^(e - 23); bf16: 2^(e - 7)), 0 at 0.
double spacing(DType dtype, double x) {
  if (x == 0) return 0;
  return std::ldexp(1.0, std::ilogb(x) - (dtype == DType::bf16 ? 7 : 23));
}

TEST_P(LinearResidualTest, EqualsTheForwardThenAnAdd) {
  const auto& [device, p] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Two identical layers (and registries), so each sees the same FP8 state.
  Linear fused_layer(kResidualIn, kResidualOut, true, device, seed, p.compute);
  Linear plain_layer(kResidualIn, kResidualOut, true, device, seed, p.compute);
  AmaxRegistry fused_registry, plain_registry;
  const Tensor x = testing::random_tensor(kResidualX, p.activation, seed + 1).to(device);
  // A residual stream larger than the layer's output, as in a transformer.
  const Tensor residual =
      testing::random_tensor(kResidualY, p.activation, seed + 2, 4.0f).to(device);
  Linear::Saved fused_saved, plain_saved;
  const Tensor fused = residual_forward(fused_layer, p, fused_registry, x, fused_saved, residual);
  const Tensor y = residual_forward(plain_layer, p, plain_registry, x, plain_saved, Tensor());
  Tensor separate = Tensor::empty(kResidualY, p.activation, device);
  ops::add(y, residual, separate);
  EXPECT_EQ(fused.shape(), kResidualY);
  EXPECT_EQ(fused.dtype(), p.activation);
  // The residual only joins the output: backward's record is the same.
  EXPECT_TRUE(testing::bitwise_equal(p.recipe ? plain_saved.input_q.data_t : plain_saved.input,
                                     p.recipe ? fused_saved.input_q.data_t : fused_saved.input));

  if (device.is_cpu() && p.activation == DType::f32) {
    // docs/NUMERICS.md: with an f32 output the addend is the GEMM then an add, bit for bit.
    EXPECT_TRUE(testing::bitwise_equal(separate, fused));
    return;
  }
  const std::vector<float> f = to_floats(fused), s = to_floats(separate);
  if (device.is_cpu()) {
    // bf16: bf16(bf16(p) + b + r) against bf16(r + bf16(p + b)) for the same product p: the two
    // inner roundings (half a spacing at |p| and at |p + b|; |p + b| <= |y| (1 + 2^-8), the
    // rounding y = bf16(p + b) included, and |p| <= that + |b|) and the two final ones.
    constexpr double kBf16RoundingMargin = 1.0 + kBf16RoundingRelL2;
    const std::vector<float> yv = to_floats(y), r = to_floats(residual);
    const std::vector<float> b = to_floats(fused_layer.bias());
    for (size_t i = 0; i < f.size(); ++i) {
      const double inner = std::fabs(yv[i]) * kBf16RoundingMargin + std::fabs(b[i % kResidualOut]);
      const double outer = std::max(std::fabs(f[i]), std::fabs(s[i]));
      ASSERT_LE(std::fabs(f[i] - s[i]), spacing(DType::bf16, inner) + spacing(DType::bf16, outer))
          << "element " << i << ": fused " << f[i] << ", separate " << s[i] << " (residual " << r[i]
          << ")";
    }
    return;
  }
  // CUDA: the GEMM with and without an addend may run different cuBLASLt algorithms, each within
  // the GEMM's CUDA-vs-reference bound (docs/NUMERICS.md), plus a BF16 rounding of each output.
  const double accumulation = p.recipe ? kFastAccumulationRelL2 : kDenseGemmRelL2;
  const double rounding = p.activation == DType::bf16 ? 2 * kBf16RoundingRelL2 : 0.0;
  EXPECT_LE(testing::relative_l2(f, s), 2 * accumulation + rounding);
}

TEST_P(LinearResidualTest, RecomputeWithTheResidualIsBitwiseTheForward) {
  const auto& [device, p] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Linear layer(kResidualIn, kResidualOut, true, device, seed, p.compute);
  AmaxRegistry registry;
  const Tensor x = testing::random_tensor(kResidualX, p.activation, seed + 1).to(device);
  const Tensor residual = testing::random_tensor(kResidualY, p.activation, seed + 2).to(device);
  Linear::Saved saved;
  const Tensor y = residual_forward(layer, p, registry, x, saved, residual);
  // The scope's end finalized the pass: delayed scales have moved on, recompute must not see it.
  Linear::Saved rebuilt = Linear::Saved::from_snapshot(saved.snapshot);
  const Tensor y_again = layer.forward(x, rebuilt, ForwardMode::recompute, residual);
  EXPECT_TRUE(testing::bitwise_equal(y, y_again));
  if (p.recipe) {
    EXPECT_TRUE(testing::bitwise_equal(saved.input_q.data_t, rebuilt.input_q.data_t));
    EXPECT_EQ(layer.fp8_state()->forward_updates(), 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, LinearResidualTest,
                         ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                                            ::testing::ValuesIn(residual_precisions())),
                         [](const auto& info) {
                           return device_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

TEST(LinearResidual, ABadResidualIsRefusedBeforeAnyStateIsRegistered) {
  Linear layer(32, 16, true, Device::cpu(), fresh_seed(), DType::bf16);
  const Tensor x = testing::random_tensor({16, 32}, DType::bf16, fresh_seed());
  Linear::Saved saved;
  EXPECT_THAT(
      [&] {
        layer.forward(x, saved, ForwardMode::normal, Tensor::zeros({16, 8}, DType::bf16));
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("expects residual [..., 16], got bf16[16, 8]")));
  EXPECT_THAT(
      [&] {
        layer.forward(x, saved, ForwardMode::normal, Tensor::zeros({8, 16}, DType::bf16));
      },
      ::testing::ThrowsMessage<Error>(
          HasSubstr("expects a residual like its output, bf16[16, 16], got bf16[8, 16]")));
  AmaxRegistry registry;
  EXPECT_THAT(
      [&] {
        Fp8Autocast scope(Recipe::delayed(), registry);
        layer.forward(x, saved, ForwardMode::normal, Tensor::zeros({16, 16}, DType::f32));
      },
      ::testing::ThrowsMessage<Error>(
          HasSubstr("expects a residual like its output, bf16[16, 16], got f32[16, 16]")));
  EXPECT_TRUE(registry.states().empty());
  EXPECT_FALSE(saved.filled());
  if (cuda_device_count() > 0) {
    EXPECT_THAT(
        [&] {
          layer.forward(x, saved, ForwardMode::normal,
                        Tensor::zeros({16, 16}, DType::bf16, Device::cuda(0)));
        },
        ::testing::ThrowsMessage<Error>(HasSubstr("its residual is bf16[16, 16] on cuda:0")));
  }
}

// ----------------------------------------------------------------------------
// FP8 casts fused into the producer of the input or of grad_output (delayed scaling only)

class LinearFusionTest : public ::testing::TestWithParam<Device> {};

TEST_P(LinearFusionTest, FusedInputFromANormMatchesQuantizingTheNormOutput) {
  // Delayed scaling lets the producer of a Linear's input (here a LayerNorm, as in a block) write
  // the FP8 input in its own kernel: same output, same saved bytes, same amax as the plain path.
  // Not in the first pass, which scales from the input's own amax, unknown to the producer before
  // it writes: the layer declines and the plain path runs; two more steps run fused.
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr int64_t kRows = 48, kIn = 64, kOut = 32;
  const Recipe recipe = Recipe::delayed();
  Linear fused_layer(kIn, kOut, true, device, seed, DType::bf16);
  Linear plain_layer(kIn, kOut, true, device, seed, DType::bf16);
  AmaxRegistry fused_registry, plain_registry;
  const Tensor gamma = testing::random_tensor({kIn}, DType::f32, seed + 1).to(device);
  const Tensor beta = testing::random_tensor({kIn}, DType::f32, seed + 2).to(device);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Tensor x =
        testing::random_tensor({kRows, kIn}, DType::bf16, seed + 3 + step, 4.0f).to(device);
    const Tensor dy =
        testing::random_tensor({kRows, kOut}, DType::bf16, seed + 5 + step).to(device);
    const auto norm = [&](const ops::FusedQuantize* fused) {
      Tensor h = Tensor::empty({kRows, kIn}, DType::bf16, device);
      Tensor mean = Tensor::empty({kRows}, DType::f32, device);
      Tensor rstd = Tensor::empty({kRows}, DType::f32, device);
      ops::layernorm_forward(x, gamma, beta, 1e-5f, h, mean, rstd, fused);
      return h;
    };
    Linear::Saved fused_saved, plain_saved;
    Tensor fused_y, plain_y;
    {
      Fp8Autocast scope(recipe, fused_registry);
      const auto target = fused_layer.fused_input(kRows, DType::bf16, fused_saved);
      ASSERT_EQ(target.has_value(), step > 0);
      fused_y = fused_layer.forward(target ? norm(&*target) : norm(nullptr), fused_saved);
    }
    {
      Fp8Autocast scope(recipe, plain_registry);
      plain_y = plain_layer.forward(norm(nullptr), plain_saved);
    }
    EXPECT_TRUE(testing::bitwise_equal(plain_y, fused_y));
    EXPECT_TRUE(testing::bitwise_equal(plain_saved.input_q.data_t, fused_saved.input_q.data_t));
    fused_layer.backward(dy, fused_saved);
    plain_layer.backward(dy, plain_saved);
    fused_registry.finalize_backward();
    plain_registry.finalize_backward();
    const auto fused_state = testing::state_tensors(*fused_layer.fp8_state());
    const auto plain_state = testing::state_tensors(*plain_layer.fp8_state());
    for (size_t i = 0; i < plain_state.size(); ++i)
      EXPECT_TRUE(testing::bitwise_equal(plain_state[i], fused_state[i])) << "state tensor " << i;
    EXPECT_TRUE(testing::bitwise_equal(plain_layer.grad_weight(), fused_layer.grad_weight()));
  }
}

TEST_P(LinearFusionTest, FusedInputIsDeclinedOutsideDelayedScaling) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  Linear layer(32, 16, false, device, fresh_seed(), DType::bf16);
  Linear::Saved saved;
  EXPECT_FALSE(layer.fused_input(16, DType::bf16, saved).has_value());  // no autocast: BF16
  AmaxRegistry registry;
  Fp8Autocast scope(Recipe::current(), registry);
  EXPECT_FALSE(layer.fused_input(16, DType::bf16, saved).has_value());
  EXPECT_FALSE(layer.fused_input(16, DType::bf16, saved, ForwardMode::inference).has_value());
  EXPECT_FALSE(saved.filled());
}

TEST_P(LinearFusionTest, FusedGradOutputIsDeclinedOutsideDelayedScalingAndChecked) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  Linear layer(32, 16, true, device, seed, DType::bf16);
  const Tensor x = testing::random_tensor({16, 32}, DType::bf16, seed + 1).to(device);
  fp8::QuantizedTensor dy_q;
  Linear::Saved bf16_saved;
  layer.forward(x, bf16_saved);  // no autocast: BF16
  EXPECT_FALSE(layer.fused_grad_output(16, bf16_saved, dy_q).has_value());
  AmaxRegistry registry;
  Linear::Saved current_saved;
  {
    Fp8Autocast scope(Recipe::current(), registry);
    layer.forward(x, current_saved);
  }
  EXPECT_FALSE(layer.fused_grad_output(16, current_saved, dy_q).has_value());
  EXPECT_FALSE(dy_q.has_rowwise());
  // A grad_output of the wrong shape is refused by name.
  Linear::Saved delayed_saved;
  {
    Fp8Autocast scope(Recipe::delayed(), registry);
    layer.forward(x, delayed_saved);
  }
  fp8::QuantizedTensor wrong = fp8::QuantizedTensor::allocate(
      8, 16, DType::e5m2, fp8::ScalingMode::per_tensor, {true, true}, device);
  EXPECT_THAT([&] { layer.backward(wrong, delayed_saved); },
              ::testing::ThrowsMessage<Error>(HasSubstr("fused grad_output [16, 16]")));
}

TEST_P(LinearFusionTest, GivenCastBuffersAreUsedAsTheyAreOrRefusedByName) {
  // A caller may hand fused_input / fused_grad_output the buffer to write (GroupedLinear carves
  // its experts' from one allocation): the right format is written in place, a wrong one refused.
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  Linear layer(32, 16, true, device, seed, DType::bf16);
  AmaxRegistry registry;
  const Tensor x = testing::random_tensor({16, 32}, DType::bf16, seed + 1).to(device);
  const Tensor dy = testing::random_tensor({16, 16}, DType::bf16, seed + 2).to(device);
  {  // a first step calibrates both passes: only then do they take fused casts
    Linear::Saved saved;
    {
      Fp8Autocast scope(Recipe::delayed(), registry);
      layer.forward(x, saved);
    }
    layer.backward(dy, saved);
    registry.finalize_backward();
  }
  const auto cast = [&](int64_t rows, int64_t cols, DType dtype) {
    return fp8::QuantizedTensor::allocate(rows, cols, dtype, fp8::ScalingMode::per_tensor,
                                          {true, true}, device);
  };
  Fp8Autocast scope(Recipe::delayed(), registry);
  Linear::Saved saved;
  const auto short_input = [&] {
    layer.fused_input(16, DType::bf16, saved, ForwardMode::normal, cast(8, 32, DType::e4m3));
  };
  EXPECT_THAT(short_input, ::testing::ThrowsMessage<Error>(HasSubstr(
                               "the cast buffer given for input must be [16, 32] e4m3 "
                               "per_tensor with both copies")));
  const fp8::QuantizedTensor given = cast(16, 32, DType::e4m3);
  const auto target = layer.fused_input(16, DType::bf16, saved, ForwardMode::normal, given);
  ASSERT_TRUE(target.has_value());
  EXPECT_EQ(target->out->data.raw_data(), given.data.raw_data());
  EXPECT_EQ(target->out->data_t.raw_data(), given.data_t.raw_data());
  ops::quantize(x, *target->out, target->args);  // the producer's write
  layer.forward(Tensor(), saved);
  fp8::QuantizedTensor wrong_dtype = cast(16, 16, DType::e4m3);  // grad_output is e5m2 (hybrid)
  EXPECT_THAT([&] { layer.fused_grad_output(16, saved, wrong_dtype); },
              ::testing::ThrowsMessage<Error>(HasSubstr(
                  "the cast buffer given for grad_output must be [16, 16] e5m2")));
  fp8::QuantizedTensor dy_q = cast(16, 16, DType::e5m2);
  const void* dy_data = dy_q.data.raw_data();
  ASSERT_TRUE(layer.fused_grad_output(16, saved, dy_q).has_value());
  EXPECT_EQ(dy_q.data.raw_data(), dy_data) << "an allocated dy_q is written as it is";
}

TEST_P(LinearFusionTest, ActivationFusedInputAndGradOutputMatchTheUnfusedLayer) {
  // An activation on both sides of a Linear, z = gelu(W gelu(x) + b), the way an MLP chains
  // them: the first gelu writes the Linear's FP8 input (without its BF16 output), the second
  // one's backward writes the Linear's FP8 grad_output and bias gradient. Everything must be
  // bitwise the plain path's. The first pass of each direction scales from its own tensor's amax,
  // which the producer cannot know before it writes: the layer declines both fusions then, and
  // the plain path runs; two more steps run fused with updated scales.
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr int64_t kRows = 160, kIn = 64, kOut = 144;  // a partial 128-row tile
  const Recipe recipe = Recipe::delayed();
  const ops::Activation gelu = ops::Activation::gelu;
  Linear fused_layer(kIn, kOut, true, device, seed, DType::bf16);
  Linear plain_layer(kIn, kOut, true, device, seed, DType::bf16);
  AmaxRegistry fused_registry, plain_registry;
  const auto plain_gelu = [&](const Tensor& in) {
    Tensor a = Tensor::empty(in.shape(), DType::bf16, device);
    ops::activation_forward(gelu, in, a);
    return a;
  };
  const auto plain_gelu_backward = [&](const Tensor& dz, const Tensor& z) {
    Tensor d = Tensor::empty(dz.shape(), DType::bf16, device);
    ops::activation_backward(gelu, dz, z, d);
    return d;
  };
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Tensor x =
        testing::random_tensor({kRows, kIn}, DType::bf16, seed + 3 + step, 3.0f).to(device);
    const Tensor dz =
        testing::random_tensor({kRows, kOut}, DType::bf16, seed + 5 + step).to(device);
    Linear::Saved fused_saved, plain_saved;
    Tensor fused_y, plain_y;
    {
      Fp8Autocast scope(recipe, fused_registry);
      const auto target = fused_layer.fused_input(kRows, DType::bf16, fused_saved);
      ASSERT_EQ(target.has_value(), step > 0);
      if (target) ops::activation_forward(gelu, x, Tensor(), &*target);
      fused_y = fused_layer.forward(target ? Tensor() : plain_gelu(x), fused_saved);
    }
    {
      Fp8Autocast scope(recipe, plain_registry);
      plain_y = plain_layer.forward(plain_gelu(x), plain_saved);
    }
    ASSERT_TRUE(testing::bitwise_equal(plain_y, fused_y));

    fp8::QuantizedTensor dy_q;
    const auto fused_dy = fused_layer.fused_grad_output(kRows, fused_saved, dy_q);
    ASSERT_EQ(fused_dy.has_value(), step > 0);
    if (fused_dy) ops::activation_backward(gelu, dz, fused_y, Tensor(), &*fused_dy);
    const Tensor fused_dx = fused_dy ? fused_layer.backward(dy_q, fused_saved)
                                     : fused_layer.backward(plain_gelu_backward(dz, fused_y),
                                                            fused_saved);
    const Tensor plain_dx = plain_layer.backward(plain_gelu_backward(dz, plain_y), plain_saved);
    fused_registry.finalize_backward();
    plain_registry.finalize_backward();

    EXPECT_TRUE(testing::bitwise_equal(plain_dx, fused_dx));
    EXPECT_TRUE(testing::bitwise_equal(plain_layer.grad_weight(), fused_layer.grad_weight()));
    EXPECT_TRUE(testing::bitwise_equal(plain_layer.grad_bias(), fused_layer.grad_bias()));
    const auto fused_state = testing::state_tensors(*fused_layer.fp8_state());
    const auto plain_state = testing::state_tensors(*plain_layer.fp8_state());
    for (size_t i = 0; i < plain_state.size(); ++i)
      EXPECT_TRUE(testing::bitwise_equal(plain_state[i], fused_state[i])) << "state tensor " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, LinearFusionTest, ::testing::ValuesIn(testing::all_backends()),
                         [](const auto& info) { return device_name(info.param); });

}  // namespace
}  // namespace octet::nn
