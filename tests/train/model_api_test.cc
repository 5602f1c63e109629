// The GPT model's surface: FP8 statistics of every module's casts, the weight casts each
// precision keeps, parameters (names, order, decay, live tensors), initialization, bad input and
// the FP8 modules' registration order.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "octet/nn/linear.h"
#include "octet/train/model.h"
#include "test_util.h"
#include "train/model_test_util.h"

namespace octet::train {
namespace {

using namespace model_test;  // NOLINT: the shared model helpers
using testing::bitwise_equal;
using testing::fresh_seed;
using ::testing::HasSubstr;
using testing::to_floats;

// ----------------------------------------------------------------------------
// FP8 statistics: input, weight and gradient of every module

/// max |x| of a host copy of x.
float host_amax(const Tensor& x) {
  float m = 0.0f;
  for (float v : host_values_f32(x)) m = std::max(m, std::fabs(v));
  return m;
}

void expect_fractions(const nn::CastStats& c) {
  EXPECT_TRUE(c.measured);
  EXPECT_GE(c.saturated_fraction, 0.0);
  EXPECT_LE(c.saturated_fraction, 1.0);
  EXPECT_GE(c.underflow_fraction, 0.0);
  EXPECT_LE(c.underflow_fraction, 1.0);
}

// The weight casts the GEMMs read, held from a training forward until the optimizer's next casts
// replace them (bench train's "weight_casts"): none in fp32, whose GEMMs read the masters; in
// bf16 a bf16 copy of every Linear weight and bias and of the head; under per-tensor FP8 two FP8
// copies of every Linear weight (row-wise and transposed, 1 byte a weight each) with their f32
// scale and two scale_invs, the bf16 biases (for the bf16-output GEMMs' fused bias), and the
// head's bf16 copy (the head is a dense GEMM).
TEST(GPTWeightCasts, BytesAreTheCopiesEachPrecisionMakes) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ModelConfig c = micro(Arch::gpt2);
  const int64_t d = c.dim, f = c.ffn;
  const int64_t weights = c.layers * (3 * d * d + d * d + d * f + f * d);
  const int64_t biases = c.layers * (3 * d + d + f + d);
  const int64_t head = c.vocab * d;  // tied to the embedding
  const int64_t fp8_scalars = c.layers * 4 * 3 * static_cast<int64_t>(sizeof(float));
  const std::pair<const char*, int64_t> cases[] = {
      {"fp32", 0},
      {"bf16", 2 * (weights + biases + head)},
      {"fp8-delayed", 2 * weights + fp8_scalars + 2 * (biases + head)},
  };
  for (const auto& [precision, expected] : cases) {
    SCOPED_TRACE(precision);
    GPT model(c, Precision::from_name(precision), Device::cpu(), seed, false);
    EXPECT_EQ(model.weight_cast_bytes(), 0) << "nothing is cast before the first forward";
    model.train_microbatch(random_tokens(kRows, 32, seed + 1), random_tokens(kRows, 32, seed + 2),
                           kBatch, kSeq, 1.0f);
    EXPECT_EQ(model.weight_cast_bytes(), expected);
  }
}

class GPTFp8StatsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GPTFp8StatsTest, StatisticsDescribeEachModuleCastWhenAskedFor) {
  const std::string precision = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPT model(micro(Arch::gpt2), Precision::from_name(precision), Device::cpu(), seed, false);
  const Tensor ids = random_tokens(kRows, 32, seed + 1);
  const Tensor targets = random_tokens(kRows, 32, seed + 2);
  model.train_microbatch(ids, targets, kBatch, kSeq, 1.0f);
  EXPECT_TRUE(model.fp8_layer_stats().empty()) << "nothing is measured unless asked for";

  model.set_collect_fp8_stats(true);
  model.train_microbatch(ids, targets, kBatch, kSeq, 1.0f);
  const std::vector<Fp8LayerStats> stats = model.fp8_layer_stats();
  const std::vector<Fp8Module> modules = model.fp8_modules();
  ASSERT_EQ(stats.size(), modules.size());
  const fp8::Recipe recipe = model.precision().recipe;
  for (size_t i = 0; i < stats.size(); ++i) {
    SCOPED_TRACE(modules[i].name);
    const Fp8LayerStats& s = stats[i];
    EXPECT_EQ(s.name, modules[i].name);
    for (const nn::CastStats* c : {&s.input, &s.weight, &s.grad_output}) expect_fractions(*c);
    // The finalizes kept the amaxes that this microbatch recorded.
    EXPECT_EQ(s.input.amax, item_f32(modules[i].state->last_amax(fp8::TensorRole::input)));
    EXPECT_EQ(s.grad_output.amax,
              item_f32(modules[i].state->last_amax(fp8::TensorRole::grad_output)));
    EXPECT_EQ(s.weight.amax, host_amax(modules[i].linear->weight()));
    EXPECT_GT(s.input.amax, 0.0f);
    EXPECT_GT(s.grad_output.amax, 0.0f);
    if (recipe.kind == fp8::RecipeKind::current) {
      EXPECT_NEAR(s.input.scale, fp8::kE4M3Max / s.input.amax, 1e-6 * s.input.scale);
      EXPECT_NEAR(s.weight.scale, fp8::kE4M3Max / s.weight.amax, 1e-6 * s.weight.scale);
      EXPECT_NEAR(s.grad_output.scale, fp8::kE5M2Max / s.grad_output.amax,
                  1e-6 * s.grad_output.scale);
    } else if (recipe.kind == fp8::RecipeKind::delayed) {
      EXPECT_GT(s.input.scale, 1.0f) << "the second forward uses the scale learned in the first";
      EXPECT_GT(s.grad_output.scale, 1.0f) << "likewise the second backward";
      EXPECT_EQ(s.weight.scale, fp8::kE4M3Max / s.weight.amax)
          << "the step's weight cast, made by the first microbatch from the weight's own amax";
    } else {
      EXPECT_EQ(s.input.scale, 0.0f) << "block recipes have no per-tensor scale";
      EXPECT_EQ(s.weight.scale, 0.0f);
      EXPECT_EQ(s.grad_output.scale, 0.0f);
    }
  }
  // Off again: the statistics stay those of the last microbatch that measured them.
  model.set_collect_fp8_stats(false);
  model.train_microbatch(random_tokens(kRows, 32, seed + 5), targets, kBatch, kSeq, 1.0f);
  const std::vector<Fp8LayerStats> kept = model.fp8_layer_stats();
  ASSERT_EQ(kept.size(), stats.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    EXPECT_EQ(kept[i].input.amax, stats[i].input.amax);
    EXPECT_EQ(kept[i].grad_output.amax, stats[i].grad_output.amax);
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, GPTFp8StatsTest,
                         ::testing::Values("fp8-delayed", "fp8-current", "fp8-block", "fp8-mxfp8"),
                         [](const auto& info) { return test_name(info.param); });

TEST(GPTFp8Stats, SaturationAndUnderflowAreCountedFromTheCodes) {
  // Delayed scaling casts with the scales of the steps before. A first microbatch calibrates them
  // on the model as initialized (a first pass scales from its own tensors); then the parameters
  // and the loss scale move far from what it saw, and the second microbatch's casts saturate and
  // underflow: E4M3's largest code is 448, and values below half its smallest subnormal (2^-10
  // after scaling) or E5M2's (2^-17) become 0.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPT model(micro(Arch::gpt2, 1), Precision::from_name("fp8-delayed"), Device::cpu(), seed, false);
  const Tensor targets = random_tokens(kRows, 32, seed + 2);
  model.train_microbatch(random_tokens(kRows, 32, seed + 1), targets, kBatch, kSeq, 1.0f);

  // The calibrated input scales are 448 over amaxes of a few units (normalized rows of 32: |x_hat|
  // <= sqrt(31) = 5.6). gamma = 1e3 on norm1 then puts qkv's input 1000x past them: it saturates
  // wherever |x_hat| is above about 0.005, nearly everywhere. gamma = 1e-7 on norm2 puts fc1's
  // input below 2^-10 wherever |x_hat| < 65 or so: everywhere. fc2's weight scaled by 1e5
  // saturates wherever |w| > 1e-5 of its calibrated amax.
  for (const Parameter& p : model.parameters()) {
    if (p.name == "blocks.0.norm1.gamma")
      Tensor(p.value).copy_from(Tensor::from_vector(std::vector<float>(32, 1e3f), {32}));
    if (p.name == "blocks.0.norm2.gamma")
      Tensor(p.value).copy_from(Tensor::from_vector(std::vector<float>(32, 1e-7f), {32}));
    if (p.name == "blocks.0.mlp.fc2.weight") {
      std::vector<float> w = host_values_f32(p.value);
      for (float& v : w) v *= 1e5f;
      Tensor(p.value).copy_from(Tensor::from_vector(w, p.value.shape()));
    }
  }
  model.on_weights_updated();  // the weights moved: cast them again
  // The loss scale 2^-40 puts every gradient far below the calibrated grad_output scales' range:
  // the residual stream's gradients (proj's and fc2's grad_output) underflow nearly everywhere.
  model.set_collect_fp8_stats(true);
  model.train_microbatch(random_tokens(kRows, 32, seed + 3), targets, kBatch, kSeq,
                         std::ldexp(1.0f, -40));
  const std::vector<Fp8LayerStats> stats = model.fp8_layer_stats();
  ASSERT_EQ(stats.size(), 4u);
  EXPECT_GT(stats[1].grad_output.underflow_fraction, 0.9) << stats[1].name;
  EXPECT_GT(stats[3].grad_output.underflow_fraction, 0.9) << stats[3].name;
  EXPECT_EQ(stats[0].name, "blocks.0.attn.qkv");
  EXPECT_GT(stats[0].input.saturated_fraction, 0.3);
  EXPECT_LT(stats[0].input.underflow_fraction, 0.01);
  EXPECT_EQ(stats[2].name, "blocks.0.mlp.fc1");
  EXPECT_LT(stats[2].input.saturated_fraction, 0.01);
  EXPECT_GT(stats[2].input.underflow_fraction, 0.9);
  EXPECT_EQ(stats[3].name, "blocks.0.mlp.fc2");
  EXPECT_GT(stats[3].weight.saturated_fraction, 0.5);
  // qkv's weight keeps its init, and its scale came from its own amax: only that element (or a
  // tie) reaches the largest code.
  EXPECT_LE(stats[0].weight.saturated_fraction * 96 * 32, 2.0) << "qkv's weight keeps its init";
}

// ----------------------------------------------------------------------------
// Parameters, initialization, errors

TEST(GPTParameters, NamesOrderDecayAndCountFollowTheArchitecture) {
  for (Arch arch : {Arch::gpt2, Arch::llama}) {
    SCOPED_TRACE(std::string(arch_name(arch)));
    const ModelConfig config = micro(arch);
    GPT model(config, Precision::from_name("bf16"), Device::cpu(), 1, false);
    const std::vector<Parameter> params = model.parameters();
    std::vector<std::string> names;
    int64_t count = 0;
    for (const Parameter& p : params) {
      names.push_back(p.name);
      count += p.value.numel();
      EXPECT_EQ(p.grad.shape(), p.value.shape()) << p.name;
      EXPECT_EQ(p.value.dtype(), DType::f32) << p.name;
      const bool decays = p.name.ends_with(".weight") || p.name == "wte" || p.name == "lm_head";
      EXPECT_EQ(p.weight_decay, decays) << p.name;
    }
    EXPECT_EQ(count, config.parameter_count());
    const bool gpt2 = arch == Arch::gpt2;
    std::vector<std::string> block0 = {
        "blocks.0.norm1.gamma",   "blocks.0.norm1.beta",       "blocks.0.attn.qkv.weight",
        "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias",
        "blocks.0.norm2.gamma",   "blocks.0.norm2.beta",       "blocks.0.mlp.fc1.weight",
        "blocks.0.mlp.fc1.bias",  "blocks.0.mlp.fc2.weight",   "blocks.0.mlp.fc2.bias"};
    if (!gpt2)
      std::erase_if(block0, [](const std::string& n) {
        return n.ends_with(".bias") || n.ends_with(".beta");
      });
    std::vector<std::string> expected =
        gpt2 ? std::vector<std::string>{"wte", "wpe"} : std::vector<std::string>{"wte"};
    expected.insert(expected.end(), block0.begin(), block0.end());
    ASSERT_GE(names.size(), expected.size());
    EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + expected.size()), expected);
    EXPECT_EQ(names.back(), gpt2 ? "final_norm.beta" : "lm_head");
  }
}

TEST(GPTParameters, ValuesAndGradientsAreTheLiveTensors) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPT model(micro(Arch::gpt2), Precision::from_name("bf16"), Device::cpu(), seed, false);
  const Tensor ids = random_tokens(kRows, 32, seed + 1);
  const Tensor targets = random_tokens(kRows, 32, seed + 2);
  const std::vector<Parameter> a = model.parameters(), b = model.parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].value.raw_data(), b[i].value.raw_data()) << a[i].name;
    EXPECT_EQ(a[i].grad.raw_data(), b[i].grad.raw_data()) << a[i].name;
  }
  model.zero_grad();
  model.train_microbatch(ids, targets, kBatch, kSeq, 1.0f);
  for (const Parameter& p : a) {
    const std::vector<float> g = to_floats(p.grad);
    EXPECT_TRUE(std::any_of(g.begin(), g.end(), [](float x) { return x != 0.0f; })) << p.name;
  }
  model.zero_grad();
  for (const Parameter& p : a) {
    const std::vector<float> g = to_floats(p.grad);
    EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](float x) { return x == 0.0f; })) << p.name;
  }
  // Writing a value (as the optimizer and the checkpoint loader do) changes the model once it is
  // told: the cached BF16 head weight is cast again.
  const float loss = model.evaluate(ids, targets, kBatch, kSeq);
  std::vector<float> wte = to_floats(a[0].value);
  for (float& x : wte) x *= 4.0f;
  Tensor(a[0].value).copy_from(Tensor::from_vector(wte, a[0].value.shape()));
  model.on_weights_updated();
  EXPECT_NE(model.evaluate(ids, targets, kBatch, kSeq), loss);
}

/// Mean and standard deviation of a tensor's values.
std::pair<double, double> moments(const Tensor& t) {
  const std::vector<float> v = to_floats(t);
  double sum = 0, sq = 0;
  for (float x : v) sum += x;
  const double mean = sum / v.size();
  for (float x : v) sq += (x - mean) * (x - mean);
  return {mean, std::sqrt(sq / v.size())};
}

TEST(GPTInit, SeededGpt2InitializationWithScaledResidualProjections) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  ModelConfig config = micro(Arch::gpt2, 8);
  config.dim = 64;
  config.ffn = 256;
  GPT a(config, Precision::from_name("fp32"), Device::cpu(), seed, false);
  GPT b(config, Precision::from_name("fp32"), Device::cpu(), seed, false);
  GPT c(config, Precision::from_name("fp32"), Device::cpu(), seed + 1, false);
  const std::vector<Parameter> pa = a.parameters(), pb = b.parameters(), pc = c.parameters();
  const double residual_std = 0.02 / std::sqrt(2.0 * config.layers);
  for (size_t i = 0; i < pa.size(); ++i) {
    SCOPED_TRACE(pa[i].name);
    EXPECT_TRUE(bitwise_equal(pa[i].value, pb[i].value));
    const auto [mean, std] = moments(pa[i].value);
    const std::string& n = pa[i].name;
    if (n.ends_with(".bias") || n.ends_with(".beta")) {
      EXPECT_EQ(std, 0.0);
      EXPECT_EQ(mean, 0.0);
    } else if (n.ends_with(".gamma")) {
      EXPECT_EQ(std, 0.0);
      EXPECT_EQ(mean, 1.0);
    } else {
      EXPECT_FALSE(bitwise_equal(pa[i].value, pc[i].value)) << "another seed, other weights";
      // >= 2048 draws: the sample std is within 10% of the target with overwhelming probability.
      const bool residual = n.ends_with("proj.weight") || n.ends_with("fc2.weight");
      EXPECT_NEAR(std, residual ? residual_std : 0.02, 0.1 * (residual ? residual_std : 0.02));
      EXPECT_NEAR(mean, 0.0, 0.1 * std);
    }
  }
}

TEST(GPTErrors, BadInputsAreRejectedWithTheReason) {
  GPT model(micro(Arch::gpt2), Precision::from_name("fp8-delayed"), Device::cpu(), 1, false);
  const Tensor ids = random_tokens(kRows, 32, 1);
  Tensor wrong = Tensor::zeros({kRows}, DType::f32);
  EXPECT_THAT([&] { model.train_microbatch(wrong, ids, kBatch, kSeq, 1.0f); },
              ::testing::ThrowsMessage<Error>(
                  HasSubstr("ids must be i32 with batch*seq = 16 elements, got f32[16]")));
  EXPECT_THAT([&] { model.evaluate(ids, random_tokens(kRows - 1, 32, 2), kBatch, kSeq); },
              ::testing::ThrowsMessage<Error>(HasSubstr("targets must be i32 with batch*seq")));
  EXPECT_THAT(
      [&] {
        model.train_microbatch(random_tokens(34, 32, 1), random_tokens(34, 32, 1), 2, 17, 1.0f);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("1 <= seq <= max_seq (16)")));
  EXPECT_THAT([&] { model.logits_at(ids, kBatch, kSeq, kSeq); },
              ::testing::ThrowsMessage<Error>(HasSubstr("position must be in [0, seq = 8)")));
  // FP8 GEMMs need batch*seq to be a multiple of 16; the pass that failed is not finalized.
  EXPECT_THAT(
      [&] {
        model.train_microbatch(random_tokens(14, 32, 1), random_tokens(14, 32, 2), 2, 7, 1.0f);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("each a multiple of 16, got M=14")));
  EXPECT_EQ(model.registry().forward_update_count(), 0);
  EXPECT_THAT([] { Precision::from_name("fp16"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("unknown precision 'fp16'")));
  ModelConfig bad = micro(Arch::gpt2);
  bad.heads = 3;
  EXPECT_THAT([&] { GPT m(bad, Precision::from_name("fp32"), Device::cpu(), 1, false); },
              ::testing::ThrowsMessage<Error>(HasSubstr("heads (3) must divide dim (32)")));
}

TEST(GPTPrecision, NamesRoundTripAndActivationDtypes) {
  for (const std::string& name : precision_names()) {
    const Precision p = Precision::from_name(name);
    EXPECT_EQ(p.name(), name);
    EXPECT_EQ(p.activation_dtype(), name == "fp32" ? DType::f32 : DType::bf16);
    EXPECT_EQ(p.kind == Precision::Kind::fp8, name.starts_with("fp8-"));
  }
}

TEST(GPTFp8Modules, EveryLinearIsRegisteredAtConstructionInAFixedOrder) {
  GPT model(micro(Arch::llama), Precision::from_name("fp8-current"), Device::cpu(), 1, false);
  const std::vector<Fp8Module> modules = model.fp8_modules();
  const std::vector<std::shared_ptr<nn::FP8State>> registered = model.registry().states();
  ASSERT_EQ(modules.size(), 8u);
  ASSERT_EQ(registered.size(), modules.size());
  const char* names[] = {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"};
  for (size_t i = 0; i < modules.size(); ++i) {
    EXPECT_EQ(modules[i].name, "blocks." + std::to_string(i / 4) + "." + names[i % 4]);
    EXPECT_EQ(modules[i].state, registered[i]);
    EXPECT_EQ(modules[i].state, modules[i].linear->fp8_state());
    EXPECT_TRUE(modules[i].state->matches(fp8::Recipe::current()));
  }
  GPT bf16(micro(Arch::llama), Precision::from_name("bf16"), Device::cpu(), 1, false);
  EXPECT_TRUE(bf16.fp8_modules().empty());
  EXPECT_TRUE(bf16.registry().states().empty());
}

}  // namespace
}  // namespace octet::train
