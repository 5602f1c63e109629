// The GPT model: gradients against central differences (both architectures), the tied
// embedding's two gradient contributions, training progress, bitwise recompute and determinism
// for every precision with one FP8 update per pass, evaluation that leaves the FP8 state alone,
// logits_at, and the model split into stages over devices (bitwise the unsplit model). FP8
// statistics, weight casts, parameters and bad input: model_api_test.cc.
#include "octet/train/model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>

#include "octet/nn/linear.h"
#include "octet/ops/optimizer.h"
#include "test_util.h"
#include "train/model_test_util.h"

namespace octet::train {
namespace {

using testing::bitwise_equal;
using testing::device_name;
using testing::fresh_seed;
using ::testing::HasSubstr;
using testing::to_floats;

using namespace model_test;  // NOLINT: the shared model helpers

/// Sets element i of the f32 tensor t (any device) to v.
void set_element(const Tensor& t, int64_t i, float v) {
  std::vector<float> values = to_floats(t);
  values[static_cast<size_t>(i)] = v;
  Tensor(t).copy_from(Tensor::from_vector(values, t.shape()).to(t.device()));
}

/// AdamW (the trainer's optimizer op) over every parameter of a model, moments beside each
/// parameter (a split model's on its stage's device).
struct AdamW {
  std::vector<Parameter> params;
  std::vector<Tensor> m, v, grads;
  Tensor norm_sq;

  explicit AdamW(GPT& model) : params(model.parameters()) {
    for (const Parameter& p : params) {
      m.push_back(Tensor::zeros(p.value.shape(), DType::f32, p.value.device()));
      v.push_back(Tensor::zeros(p.value.shape(), DType::f32, p.value.device()));
      grads.push_back(p.grad);
    }
    norm_sq = Tensor::zeros({1}, DType::f32, model.device());
  }

  /// One step from the accumulated gradients (clipped to norm 1), then tells the model.
  void step(GPT& model, int64_t step, float lr) {
    norm_sq.zero();
    ops::global_norm_squared(grads.data(), static_cast<int>(grads.size()), norm_sq);
    for (size_t i = 0; i < params.size(); ++i) {
      ops::AdamWArgs args;
      args.lr = lr;
      args.step = step;
      args.weight_decay = params[i].weight_decay ? 0.1f : 0.0f;
      ops::adamw_step(params[i].value, params[i].grad, m[i], v[i], norm_sq, args);
    }
    model.on_weights_updated();
  }
};

/// Five-point central difference of evaluate() over element i of a parameter, in float64:
/// (-L(x+2h) + 8 L(x+h) - 8 L(x-h) + L(x-2h)) / 12h, whose truncation error is O(h^4). The
/// residual stream at initialization is small (~0.03), so a perturbation of a bias that adds to
/// it is not small relative to it, and the plain central difference (O(h^2)) would be off.
double central_difference(GPT& model, const Parameter& p, int64_t i, const Tensor& ids,
                          const Tensor& targets, int64_t batch, int64_t seq, float step) {
  const float center = to_floats(p.value)[static_cast<size_t>(i)];
  auto loss_at = [&](int k) {
    set_element(p.value, i, center + static_cast<float>(k) * step);
    model.on_weights_updated();
    return double(model.evaluate(ids, targets, batch, seq));
  };
  const double derivative =
      (-loss_at(2) + 8 * loss_at(1) - 8 * loss_at(-1) + loss_at(-2)) / (12.0 * double(step));
  set_element(p.value, i, center);
  model.on_weights_updated();
  return derivative;
}

// ----------------------------------------------------------------------------
// FP32 gradients against central differences

class GPTGradientTest : public ::testing::TestWithParam<Arch> {};

/// Step and tolerance of the five-point stencil. The loss is a float computed through a few
/// hundred f32 roundings (~1e-6 relative to ~ln 32); through the stencil's weights (18 / 12h)
/// that is ~1e-4 absolute, which kFdAbs covers. Its truncation error (h^4) is far below.
constexpr float kFdStep = 1.0f / 128;
constexpr double kFdAbs = 2e-4;
constexpr double kFdRel = 2e-2;
constexpr int kSamplesPerParameter = 3;

TEST_P(GPTGradientTest, EveryParameterMatchesCentralDifferences) {
  const Arch arch = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPT model(micro(arch), Precision::from_name("fp32"), Device::cpu(), seed, false);
  const Tensor ids = random_tokens(kRows, 32, seed + 1);
  Tensor targets = random_tokens(kRows, 32, seed + 2);
  targets.data<int32_t>()[3] = -1;  // an ignored target: no loss, no gradient
  model.zero_grad();
  model.train_microbatch(ids, targets, kBatch, kSeq, 1.0f);

  std::mt19937_64 rng(seed + 3);
  for (const Parameter& p : model.parameters()) {
    const std::vector<float> analytic = to_floats(p.grad);
    for (int s = 0; s < kSamplesPerParameter; ++s) {
      const int64_t i = static_cast<int64_t>(rng() % static_cast<uint64_t>(p.value.numel()));
      const double numeric = central_difference(model, p, i, ids, targets, kBatch, kSeq, kFdStep);
      EXPECT_NEAR(analytic[static_cast<size_t>(i)], numeric, kFdAbs + kFdRel * std::fabs(numeric))
          << p.name << " element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, GPTGradientTest, ::testing::Values(Arch::gpt2, Arch::llama),
                         [](const auto& info) { return std::string(arch_name(info.param)); });

TEST(GPTZeroGrad, EveryGradientReadsZeroEitherWay) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const Arch arch : {Arch::gpt2, Arch::llama}) {
    for (const nn::ZeroGrad how : {nn::ZeroGrad::now, nn::ZeroGrad::on_next_write}) {
      GPT model(micro(arch), Precision::from_name("fp32"), Device::cpu(), seed, false);
      model.train_microbatch(random_tokens(kRows, 32, seed + 1), random_tokens(kRows, 32, seed + 2),
                             kBatch, kSeq, 1.0f);
      model.zero_grad(how);
      model.settle_grads();  // no backward came: the pending weight gradients are zeroed here
      for (const Parameter& p : model.parameters()) {
        for (float v : to_floats(p.grad)) ASSERT_EQ(v, 0.0f) << arch_name(arch) << " " << p.name;
      }
    }
  }
}

TEST(GPTTiedEmbedding, GradientHoldsTheHeadAndTheEmbeddingContributions) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPT model(micro(Arch::gpt2, 1), Precision::from_name("fp32"), Device::cpu(), seed, false);
  // One sequence of distinct tokens: the embedding's part of wte's gradient at row ids[t] is then
  // exactly wpe's gradient at row t, and what remains is the head's part.
  constexpr int64_t kTokens = 8;
  Tensor ids = Tensor::empty({kTokens}, DType::i32);
  for (int64_t t = 0; t < kTokens; ++t) ids.data<int32_t>()[t] = static_cast<int32_t>(3 * t + 1);
  const Tensor targets = random_tokens(kTokens, 32, seed + 1);
  model.zero_grad();
  model.train_microbatch(ids, targets, 1, kTokens, 1.0f);
  const std::vector<Parameter> params = model.parameters();
  const Parameter& wte = params[0];
  const Parameter& wpe = params[1];
  ASSERT_EQ(wte.name, "wte");
  ASSERT_EQ(wpe.name, "wpe");
  const std::vector<float> dwte = to_floats(wte.grad), dwpe = to_floats(wpe.grad);
  const int64_t dim = 32;
  double head_part = 0, embedding_part = 0;
  for (int64_t t = 0; t < kTokens; ++t) {
    const int64_t row = ids.data<int32_t>()[t];
    for (int64_t j = 0; j < dim; ++j) {
      const double embed = dwpe[t * dim + j];
      embedding_part = std::max(embedding_part, std::fabs(embed));
      head_part = std::max(head_part, std::fabs(dwte[row * dim + j] - embed));
    }
  }
  EXPECT_GT(head_part, 1e-4);
  EXPECT_GT(embedding_part, 1e-4);
  // And the sum is the gradient: central differences on rows that received both parts.
  std::mt19937_64 rng(seed + 2);
  for (int s = 0; s < 6; ++s) {
    const int64_t row = ids.data<int32_t>()[rng() % kTokens];
    const int64_t i = row * dim + static_cast<int64_t>(rng() % dim);
    const double numeric = central_difference(model, wte, i, ids, targets, 1, kTokens, kFdStep);
    EXPECT_NEAR(dwte[i], numeric, kFdAbs + kFdRel * std::fabs(numeric)) << "wte element " << i;
  }
  // A token that is not in the input still gets the head's gradient.
  double unused_row = 0;
  for (int64_t j = 0; j < dim; ++j) unused_row = std::max(unused_row, std::fabs(double(dwte[j])));
  EXPECT_GT(unused_row, 0.0);
}

// ----------------------------------------------------------------------------
// Training makes progress

using TrainParam = std::tuple<Arch, std::string>;
class GPTTrainingTest : public ::testing::TestWithParam<TrainParam> {};

TEST_P(GPTTrainingTest, AdamWStepsLowerTheLossOfAFixedBatch) {
  const auto& [arch, precision] = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPT model(micro(arch), Precision::from_name(precision), Device::cpu(), seed, false);
  const Tensor ids = random_tokens(kRows, 32, seed + 1);
  const Tensor targets = random_tokens(kRows, 32, seed + 2);
  AdamW optimizer(model);
  constexpr int kTrainSteps = 8;
  std::vector<float> losses;
  for (int step = 1; step <= kTrainSteps; ++step) {
    model.zero_grad();
    losses.push_back(model.train_microbatch(ids, targets, kBatch, kSeq, 1.0f));
    ASSERT_TRUE(std::isfinite(losses.back())) << "step " << step;
    optimizer.step(model, step, 1e-2f);
  }
  // Uniform guessing over 32 tokens costs ln 32 = 3.47; a memorized batch much less.
  EXPECT_NEAR(losses.front(), std::log(32.0f), 0.2f);
  EXPECT_LT(losses.back(), losses.front() - 1.0f);
  EXPECT_LT(model.evaluate(ids, targets, kBatch, kSeq), losses.back());
}

INSTANTIATE_TEST_SUITE_P(Precisions, GPTTrainingTest,
                         ::testing::Combine(::testing::Values(Arch::gpt2, Arch::llama),
                                            ::testing::ValuesIn(precision_names())),
                         [](const auto& info) {
                           return std::string(arch_name(std::get<0>(info.param))) + "_" +
                                  test_name(std::get<1>(info.param));
                         });

// ----------------------------------------------------------------------------
// Recompute and determinism: bitwise, one FP8 update per pass

constexpr int kSteps = 2;
constexpr int kMicrobatches = 3;  ///< per step

struct ModelRun {
  std::vector<float> losses;   ///< of every microbatch
  std::vector<Tensor> grads;   ///< every parameter gradient at the end of every step (on the CPU)
  std::vector<Tensor> states;  ///< every FP8 state tensor at the end
  int64_t forward_updates = 0, backward_updates = 0;
  std::vector<int64_t> per_state;
};

/// kSteps optimizer steps of kMicrobatches accumulated microbatches each, of the model split
/// over `stages` (one device: unsplit).
ModelRun run_model(const std::vector<Device>& stages, const ModelConfig& config,
                   const std::string& precision, bool recompute, uint64_t seed) {
  GPT model(config, Precision::from_name(precision), stages, seed, recompute);
  AdamW optimizer(model);
  ModelRun run;
  for (int step = 1; step <= kSteps; ++step) {
    model.zero_grad();
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      const uint64_t data_seed = seed + 11 * (step * kMicrobatches + mb);
      const Tensor ids = random_tokens(kRows, 32, data_seed);
      const Tensor targets = random_tokens(kRows, 32, data_seed + 1);
      run.losses.push_back(
          model.train_microbatch(ids, targets, kBatch, kSeq, 1.0f / kMicrobatches));
    }
    for (const Parameter& p : model.parameters()) run.grads.push_back(p.grad.to(Device::cpu()));
    optimizer.step(model, step, 1e-2f);
  }
  for (const Fp8Module& mod : model.fp8_modules()) {
    for (nn::Pass pass : {nn::Pass::forward, nn::Pass::backward}) {
      const ops::ScalingGroup& g = mod.state->group(pass);
      for (const Tensor& t : {g.amax_history, g.scale, g.scale_inv, mod.state->last_amax(pass)})
        run.states.push_back(t.to(Device::cpu()));
    }
    run.per_state.push_back(mod.state->forward_updates());
    run.per_state.push_back(mod.state->backward_updates());
  }
  run.forward_updates = model.registry().forward_update_count();
  run.backward_updates = model.registry().backward_update_count();
  return run;
}

ModelRun run_model(const Device& device, Arch arch, const std::string& precision, bool recompute,
                   uint64_t seed) {
  return run_model({device}, micro(arch), precision, recompute, seed);
}

void expect_bitwise_same(const ModelRun& a, const ModelRun& b, const char* what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_EQ(std::bit_cast<uint32_t>(a.losses[i]), std::bit_cast<uint32_t>(b.losses[i]))
        << "loss of microbatch " << i << ": " << a.losses[i] << " vs " << b.losses[i];
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_TRUE(bitwise_equal(a.grads[i], b.grads[i])) << "gradient " << i;
  ASSERT_EQ(a.states.size(), b.states.size());
  for (size_t i = 0; i < a.states.size(); ++i)
    EXPECT_TRUE(bitwise_equal(a.states[i], b.states[i])) << "FP8 state tensor " << i;
}

using RunParam = std::tuple<Device, Arch, std::string>;

/// Every backend x both architectures x every precision.
auto every_run() {
  return ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                            ::testing::Values(Arch::gpt2, Arch::llama),
                            ::testing::ValuesIn(precision_names()));
}

std::string run_name(const ::testing::TestParamInfo<RunParam>& info) {
  return device_name(std::get<0>(info.param)) + "_" +
         std::string(arch_name(std::get<1>(info.param))) + "_" + test_name(std::get<2>(info.param));
}

class GPTRecomputeTest : public ::testing::TestWithParam<RunParam> {};

TEST_P(GPTRecomputeTest, RecomputeAndRepeatRunsAreBitwiseEqualWithOneUpdatePerPass) {
  const auto& [device, arch, precision] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ModelRun plain = run_model(device, arch, precision, false, seed);
  const ModelRun again = run_model(device, arch, precision, false, seed);
  const ModelRun recomputed = run_model(device, arch, precision, true, seed);
  for (float loss : plain.losses) ASSERT_TRUE(std::isfinite(loss));
  expect_bitwise_same(plain, again, "two identical models");
  expect_bitwise_same(plain, recomputed, "with and without recompute");
  const bool fp8 = precision.starts_with("fp8");
  const int64_t layers = micro(arch).layers;
  constexpr int64_t kPasses = kSteps * kMicrobatches;
  for (const ModelRun* run : {&plain, &recomputed}) {
    EXPECT_EQ(run->forward_updates, fp8 ? kPasses : 0);
    EXPECT_EQ(run->backward_updates, fp8 ? kPasses : 0);
    EXPECT_EQ(run->per_state.size(), fp8 ? static_cast<size_t>(2 * 4 * layers) : 0u);
    for (int64_t n : run->per_state) EXPECT_EQ(n, kPasses);
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, GPTRecomputeTest, every_run(), run_name);

TEST(GPTPlacement, ModelOnSecondGpuMatchesTheFirstBitwise) {
  if (cuda_device_count() < 2)
    GTEST_SKIP() << "needs 2 GPUs, " << cuda_device_count() << " visible";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const std::string precision : {"bf16", "fp8-delayed", "fp8-block"}) {
    SCOPED_TRACE(precision);
    const ModelRun on0 = run_model(Device::cuda(0), Arch::gpt2, precision, false, seed);
    const ModelRun on1 = run_model(Device::cuda(1), Arch::gpt2, precision, true, seed);
    expect_bitwise_same(on0, on1, "cuda:0 vs cuda:1 (with recompute)");
  }
}

// ----------------------------------------------------------------------------
// A model split into stages over devices equals the unsplit model bitwise

class GPTSplitTest : public ::testing::TestWithParam<RunParam> {};

// Stages on one device run every copy a split over GPUs makes (activations and gradients between
// stages, the tied head's weight and gradient), so the order of the work is checked on any
// backend; GPTSplit.TwoGpus... checks the copies between GPUs.
TEST_P(GPTSplitTest, StagesOnOneDeviceEqualTheUnsplitModelBitwise) {
  const auto& [device, arch, precision] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ModelConfig config = micro(arch, 3);
  const ModelRun whole = run_model({device}, config, precision, false, seed);
  for (float loss : whole.losses) ASSERT_TRUE(std::isfinite(loss));
  expect_bitwise_same(whole, run_model({device, device}, config, precision, false, seed),
                      "two stages (blocks 0 | 1, 2)");
  expect_bitwise_same(whole, run_model({device, device, device}, config, precision, true, seed),
                      "three stages, with recompute");
}

INSTANTIATE_TEST_SUITE_P(Precisions, GPTSplitTest, every_run(), run_name);

TEST(GPTSplit, TwoGpusEqualEitherGpuAloneBitwiseWithTheCurrentDeviceLeftAt0) {
  if (cuda_device_count() < 2)
    GTEST_SKIP() << "needs 2 GPUs, " << cuda_device_count() << " visible";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // The current device stays the runtime's default, 0: octet switches it only inside an op.
  const Device gpu0 = Device::cuda(0), gpu1 = Device::cuda(1);
  for (const Arch arch : {Arch::gpt2, Arch::llama}) {
    for (const std::string& precision : precision_names()) {
      SCOPED_TRACE(std::string(arch_name(arch)) + " " + precision);
      const ModelConfig config = micro(arch, 3);
      const ModelRun on0 = run_model({gpu0}, config, precision, false, seed);
      expect_bitwise_same(on0, run_model({gpu1}, config, precision, false, seed), "cuda:1 alone");
      expect_bitwise_same(on0, run_model({gpu0, gpu1}, config, precision, false, seed),
                          "split cuda:0,1");
      expect_bitwise_same(on0, run_model({gpu1, gpu0}, config, precision, true, seed),
                          "split cuda:1,0 with recompute");
    }
  }
}

TEST(GPTSplit, MoreStagesThanLayersAreRefused) {
  const Device cpu = Device::cpu();
  EXPECT_THAT(testing::error_of([&] {
                GPT(micro(Arch::gpt2, 2), Precision::from_name("fp32"), {cpu, cpu, cpu}, 1, false);
              }),
              HasSubstr("a split over 3 devices (cpu,cpu,cpu) needs at least as many layers, "
                        "got 2"));
  EXPECT_THAT(testing::error_of([&] {
                GPT(micro(Arch::gpt2, 2), Precision::from_name("fp32"), std::vector<Device>{}, 1,
                    false);
              }),
              HasSubstr("no device to build the model on"));
}

// ----------------------------------------------------------------------------
// Evaluation and logits_at leave the FP8 state alone

using EvalParam = std::tuple<Device, std::string>;
class GPTEvaluateTest : public ::testing::TestWithParam<EvalParam> {};

/// Every byte of every FP8 state, and each Linear's weight-cast count.
std::pair<std::vector<std::vector<uint8_t>>, std::vector<int64_t>> fp8_snapshot(const GPT& model) {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<int64_t> casts;
  for (const Fp8Module& mod : model.fp8_modules()) {
    for (nn::Pass pass : {nn::Pass::forward, nn::Pass::backward}) {
      const ops::ScalingGroup& g = mod.state->group(pass);
      for (const Tensor& t : {g.amax_history, g.scale, g.scale_inv, mod.state->last_amax(pass)})
        bytes.push_back(testing::to_bytes(t));
    }
    casts.push_back(mod.linear->weight_casts());
  }
  return {bytes, casts};
}

TEST_P(GPTEvaluateTest, EvaluationChangesNoFp8StateAndSeesWhatTrainingSees) {
  const auto& [device, precision] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPT model(micro(Arch::llama), Precision::from_name(precision), device, seed, false);
  const Tensor ids = random_tokens(kRows, 32, seed + 1);
  const Tensor targets = random_tokens(kRows, 32, seed + 2);
  model.train_microbatch(random_tokens(kRows, 32, seed + 3), targets, kBatch, kSeq, 1.0f);
  model.on_weights_updated();

  const auto before = fp8_snapshot(model);
  const int64_t forward_updates = model.registry().forward_update_count();
  const int64_t backward_updates = model.registry().backward_update_count();
  const float loss = model.evaluate(ids, targets, kBatch, kSeq);
  const Tensor logits = model.logits_at(ids, kBatch, kSeq, kSeq - 1);
  EXPECT_EQ(std::bit_cast<uint32_t>(loss),
            std::bit_cast<uint32_t>(model.evaluate(ids, targets, kBatch, kSeq)));
  EXPECT_EQ(fp8_snapshot(model), before);
  EXPECT_EQ(model.registry().forward_update_count(), forward_updates);
  EXPECT_EQ(model.registry().backward_update_count(), backward_updates);
  EXPECT_EQ(logits.shape(), (Shape{kBatch, 32}));
  EXPECT_TRUE(logits.device().is_cpu());

  // Training sees the same scales, so its loss is evaluate's, bit for bit.
  const float trained = model.train_microbatch(ids, targets, kBatch, kSeq, 1.0f);
  EXPECT_EQ(std::bit_cast<uint32_t>(trained), std::bit_cast<uint32_t>(loss))
      << trained << " vs " << loss;
}

INSTANTIATE_TEST_SUITE_P(Precisions, GPTEvaluateTest,
                         ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                                            ::testing::ValuesIn(precision_names())),
                         [](const auto& info) {
                           return device_name(std::get<0>(info.param)) + "_" +
                                  test_name(std::get<1>(info.param));
                         });

class GPTLogitsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GPTLogitsTest, LogitsAtAgreeWithTheLossAndIgnoreLaterTokens) {
  const std::string precision = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  GPT model(micro(Arch::gpt2), Precision::from_name(precision), Device::cpu(), seed, false);
  constexpr int64_t kPosition = 5;
  const Tensor ids = random_tokens(kRows, 32, seed + 1);
  // Only the targets at kPosition count, so the loss is the mean over the batch of
  // logsumexp(logits) - logits[target] at that position.
  Tensor targets = Tensor::empty({kRows}, DType::i32);
  std::fill_n(targets.data<int32_t>(), kRows, -1);
  for (int64_t b = 0; b < kBatch; ++b) targets.data<int32_t>()[b * kSeq + kPosition] = 7 + b;
  const Tensor logits = model.logits_at(ids, kBatch, kSeq, kPosition);
  const float* l = logits.data<float>();
  double expected = 0;
  for (int64_t b = 0; b < kBatch; ++b) {
    double top = l[b * 32];
    for (int64_t v = 0; v < 32; ++v) top = std::max(top, double(l[b * 32 + v]));
    double sum = 0;
    for (int64_t v = 0; v < 32; ++v) sum += std::exp(l[b * 32 + v] - top);
    expected += top + std::log(sum) - l[b * 32 + 7 + b];
  }
  expected /= kBatch;
  EXPECT_NEAR(model.evaluate(ids, targets, kBatch, kSeq), expected, 1e-5 * std::fabs(expected));

  // Causal attention: tokens after kPosition change nothing (per-tensor current scaling would:
  // its scale comes from the whole input, so it is not in this list).
  Tensor changed = ids.clone();
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t t = kPosition + 1; t < kSeq; ++t)
      changed.data<int32_t>()[b * kSeq + t] = (changed.data<int32_t>()[b * kSeq + t] + 5) % 32;
  EXPECT_TRUE(bitwise_equal(logits, model.logits_at(changed, kBatch, kSeq, kPosition)));
}

INSTANTIATE_TEST_SUITE_P(Precisions, GPTLogitsTest,
                         ::testing::Values("fp32", "bf16", "fp8-delayed", "fp8-block", "fp8-mxfp8"),
                         [](const auto& info) { return test_name(info.param); });

}  // namespace
}  // namespace octet::train
