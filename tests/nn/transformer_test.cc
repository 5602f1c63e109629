// Transformer modules: block gradients against central differences, the fused residual adds
// against separate ones, activation recompute bitwise equal to a plain run for every precision
// with one FP8 update per pass, what an FP8 training forward keeps (no Linear input, recast in
// backward to the same bits), inference forwards that leave the FP8 state alone, and the Linear
// observer.
#include "octet/nn/transformer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <tuple>
#include <utility>

#include "nn/nn_check.h"
#include "octet/nn/autocast.h"
#include "octet/nn/fusion.h"
#include "octet/ops/activation.h"
#include "test_util.h"

namespace octet::nn {
namespace {

using fp8::Recipe;
using testing::all_recipes;
using testing::bitwise_equal;
using testing::device_name;
using testing::fresh_seed;
using ::testing::HasSubstr;
using testing::state_tensors;
using testing::to_floats;

// Sizes every FP8 GEMM accepts (multiples of 16), small enough for the CPU reference.
constexpr int64_t kBatch = 2;
constexpr int64_t kSeq = 8;
constexpr int64_t kRows = kBatch * kSeq;
constexpr int64_t kDim = 32;
constexpr int64_t kHeads = 2;
constexpr int64_t kFfn = 64;

/// GPT-2 flavour (LayerNorm, GELU, biases) or Llama flavour (RMSNorm, SwiGLU, RoPE, no biases).
BlockConfig block_config(bool llama) {
  return BlockConfig{.norm = llama ? NormKind::rmsnorm : NormKind::layernorm,
                     .dim = kDim,
                     .heads = kHeads,
                     .ffn = kFfn,
                     .activation = llama ? ops::Activation::swiglu : ops::Activation::gelu,
                     .bias = !llama,
                     .rope = llama,
                     .rope_theta = 10000.0f,
                     .norm_eps = 1e-5f};
}

/// Every trainable tensor of a block with its gradient, in a fixed order.
std::vector<std::pair<Tensor, Tensor>> block_parameters(TransformerBlock& block) {
  std::vector<std::pair<Tensor, Tensor>> out;
  for (Norm* n : {&block.norm1(), &block.norm2()}) {
    out.emplace_back(n->gamma(), n->grad_gamma());
    if (n->beta().defined()) out.emplace_back(n->beta(), n->grad_beta());
  }
  for (int s = 0; s < kBlockLinears; ++s) {
    Linear& l = block.linear(static_cast<LinearSlot>(s));
    out.emplace_back(l.weight(), l.grad_weight());
    if (l.bias().defined()) out.emplace_back(l.bias(), l.grad_bias());
  }
  return out;
}

/// Sets element i of the f32 tensor t (any device) to v; returns the value it held.
float exchange(const Tensor& t, int64_t i, float v) {
  std::vector<float> values = to_floats(t);
  const float old = values[static_cast<size_t>(i)];
  values[static_cast<size_t>(i)] = v;
  Tensor(t).copy_from(Tensor::from_vector(values, t.shape()).to(t.device()));
  return old;
}

// ----------------------------------------------------------------------------
// FP32 gradients against central differences

using FlavourParam = std::tuple<Device, bool>;  // device, llama
class TransformerBlockGradientTest : public ::testing::TestWithParam<FlavourParam> {};

/// Elements of a tensor the check samples (all of them for small tensors).
constexpr int kSamplesPerTensor = 6;
/// Step of the central difference: the block is smooth, so the truncation error (h^2/6 times a
/// third derivative of order 1) stays near 4e-5, and f32 rounding of the outputs divided by 2h
/// near 1e-4.
constexpr float kStep = 1.0f / 64;
constexpr double kFdAbs = 2e-3;
constexpr double kFdRel = 2e-2;

TEST_P(TransformerBlockGradientTest, MatchesCentralDifferences) {
  const auto& [device, llama] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  TransformerBlock block(block_config(llama), device, seed, DType::f32, /*recompute=*/false);
  const Tensor x = testing::random_tensor({kRows, kDim}, DType::f32, seed + 1).to(device);
  const std::vector<float> g =
      to_floats(testing::random_tensor({kRows, kDim}, DType::f32, seed + 2));
  // loss = sum(y * g) in float64, so dloss/dy = g.
  auto loss = [&] {
    TransformerBlock::Saved saved;
    const std::vector<float> y =
        to_floats(block.forward(x, kBatch, kSeq, saved, ForwardMode::inference));
    double sum = 0;
    for (size_t i = 0; i < y.size(); ++i) sum += double(y[i]) * g[i];
    return sum;
  };
  TransformerBlock::Saved saved;
  block.forward(x, kBatch, kSeq, saved);
  const Tensor dx = block.backward(Tensor::from_vector(g, {kRows, kDim}).to(device), saved);

  std::vector<std::pair<Tensor, Tensor>> checks = block_parameters(block);
  checks.emplace(checks.begin(), x, dx);
  std::mt19937_64 rng(seed + 3);
  for (size_t c = 0; c < checks.size(); ++c) {
    const auto& [value, grad] = checks[c];
    const std::vector<float> analytic = to_floats(grad);
    for (int s = 0; s < kSamplesPerTensor; ++s) {
      const int64_t i = static_cast<int64_t>(rng() % static_cast<uint64_t>(value.numel()));
      const float center = to_floats(value)[static_cast<size_t>(i)];
      const float plus = center + kStep, minus = center - kStep;
      exchange(value, i, plus);
      block.on_weights_updated();
      const double loss_plus = loss();
      exchange(value, i, minus);
      block.on_weights_updated();
      const double loss_minus = loss();
      exchange(value, i, center);
      block.on_weights_updated();
      const double numeric = (loss_plus - loss_minus) / (double(plus) - double(minus));
      EXPECT_NEAR(analytic[static_cast<size_t>(i)], numeric, kFdAbs + kFdRel * std::fabs(numeric))
          << (c == 0 ? "dx" : "parameter " + std::to_string(c - 1)) << " element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Flavours, TransformerBlockGradientTest,
                         ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return device_name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_llama" : "_gpt2");
                         });

// ----------------------------------------------------------------------------
// The residual adds, fused into proj's and fc2's GEMMs, against the unfused composition

class TransformerBlockResidualTest : public ::testing::TestWithParam<FlavourParam> {};

TEST_P(TransformerBlockResidualTest, FusedResidualAddsEqualTheSeparateAdds) {
  // r = x + proj(attn), y = r + fc2(act), rebuilt from the record with separate ops::add calls:
  // bitwise on the CPU in f32 (docs/NUMERICS.md: an f32 addend is the GEMM then an add), within
  // the CUDA GEMM bound on a GPU. saved.residual, norm2's input, is r itself.
  const auto& [device, llama] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const BlockConfig config = block_config(llama);
  TransformerBlock block(config, device, seed, DType::f32, /*recompute=*/false);
  const Tensor x = testing::random_tensor({kRows, kDim}, DType::f32, seed + 1, 2.0f).to(device);
  TransformerBlock::Saved saved;
  const Tensor y = block.forward(x, kBatch, kSeq, saved);

  auto separate = [&](Linear& layer, const Tensor& input, const Tensor& residual) {
    Linear::Saved record;
    const Tensor out = layer.forward(input, record, ForwardMode::inference);
    Tensor sum = Tensor::empty(residual.shape(), residual.dtype(), device);
    ops::add(residual, out, sum);
    return sum;
  };
  const Tensor r = separate(block.attn().proj(), saved.attn.out, x);
  Tensor act = Tensor::empty({kRows, kFfn}, DType::f32, device);
  ops::activation_forward(config.activation, saved.mlp.hidden, act);
  const Tensor y_separate = separate(block.mlp().fc2(), act, r);
  EXPECT_EQ(saved.norm2.input.raw_data(), saved.residual.raw_data()) << "norm2 reads r";
  if (device.is_cpu()) {
    EXPECT_TRUE(bitwise_equal(r, saved.residual));
    EXPECT_TRUE(bitwise_equal(y_separate, y));
  } else {
    // cuBLASLt may pick another algorithm with C != D: both within the f32 GEMM bound, 1e-5.
    constexpr double kCudaF32GemmRelL2 = 1e-5;
    EXPECT_LE(testing::relative_l2(to_floats(saved.residual), to_floats(r)), 2 * kCudaF32GemmRelL2);
    EXPECT_LE(testing::relative_l2(to_floats(y), to_floats(y_separate)), 2 * kCudaF32GemmRelL2);
  }
}

INSTANTIATE_TEST_SUITE_P(Flavours, TransformerBlockResidualTest,
                         ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return device_name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_llama" : "_gpt2");
                         });

// ----------------------------------------------------------------------------
// Recompute: bitwise the same as without, one FP8 update per pass

/// A block's GEMM precision: f32 or bf16 dense, or FP8 under a recipe (bf16 activations).
struct BlockPrecision {
  std::string name;
  DType activation;
  std::optional<Recipe> recipe;
};

void PrintTo(const BlockPrecision& p, std::ostream* out) { *out << p.name; }

std::vector<BlockPrecision> all_precisions() {
  return {{"fp32", DType::f32, std::nullopt},
          {"bf16", DType::bf16, std::nullopt},
          {"fp8_delayed", DType::bf16, Recipe::delayed()},
          {"fp8_current", DType::bf16, Recipe::current()},
          {"fp8_block", DType::bf16, Recipe::block()},
          {"fp8_mxfp8", DType::bf16, Recipe::mxfp8()}};
}

constexpr int kMicrobatches = 3;

struct BlockRun {
  std::vector<Tensor> outputs;  ///< y and dx of every microbatch
  std::vector<Tensor> grads;    ///< every parameter gradient at the end
  std::vector<Tensor> states;   ///< every FP8 state tensor at the end
  int64_t forward_updates = 0, backward_updates = 0;
  std::vector<int64_t> per_state;
};

/// kMicrobatches accumulated microbatches through one block.
BlockRun run_block(const Device& device, bool llama, const BlockPrecision& p, bool recompute,
                   uint64_t seed) {
  TransformerBlock block(block_config(llama), device, seed, p.activation, recompute);
  AmaxRegistry registry;
  BlockRun run;
  for (int m = 0; m < kMicrobatches; ++m) {
    const uint64_t mb = seed + 7919 * (m + 1);
    const Tensor x = testing::random_tensor({kRows, kDim}, p.activation, mb, 2.0f).to(device);
    const Tensor dy = testing::random_tensor({kRows, kDim}, p.activation, mb + 1).to(device);
    TransformerBlock::Saved saved;
    Tensor y;
    if (p.recipe) {
      Fp8Autocast scope(*p.recipe, registry);
      y = block.forward(x, kBatch, kSeq, saved);
    } else {
      y = block.forward(x, kBatch, kSeq, saved);
    }
    // Recompute keeps the input and the snapshots only.
    EXPECT_EQ(saved.complete, !recompute);
    EXPECT_EQ(saved.attn.lse.defined(), !recompute);
    EXPECT_EQ(saved.mlp.hidden.defined(), !recompute);
    run.outputs.push_back(y.to(Device::cpu()));
    run.outputs.push_back(block.backward(dy, saved).to(Device::cpu()));
    EXPECT_FALSE(saved.input.defined()) << "backward releases the record";
    if (p.recipe) registry.finalize_backward();
  }
  for (const auto& [value, grad] : block_parameters(block))
    run.grads.push_back(grad.to(Device::cpu()));
  if (p.recipe) {
    for (int s = 0; s < kBlockLinears; ++s) {
      const FP8State& state = *block.linear(static_cast<LinearSlot>(s)).fp8_state();
      for (const Tensor& t : state_tensors(state)) run.states.push_back(t.to(Device::cpu()));
      run.per_state.push_back(state.forward_updates());
      run.per_state.push_back(state.backward_updates());
    }
  }
  run.forward_updates = registry.forward_update_count();
  run.backward_updates = registry.backward_update_count();
  return run;
}

/// Every output, gradient and FP8 state tensor of `b` bitwise those of `a`.
void expect_same_run(const BlockRun& a, const BlockRun& b) {
  ASSERT_EQ(a.outputs.size(), b.outputs.size());
  for (size_t i = 0; i < a.outputs.size(); ++i)
    EXPECT_TRUE(bitwise_equal(a.outputs[i], b.outputs[i]))
        << (i % 2 ? "dx" : "y") << " of microbatch " << i / 2;
  for (size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_TRUE(bitwise_equal(a.grads[i], b.grads[i])) << "gradient " << i;
  ASSERT_EQ(a.states.size(), b.states.size());
  for (size_t i = 0; i < a.states.size(); ++i)
    EXPECT_TRUE(bitwise_equal(a.states[i], b.states[i])) << "FP8 state tensor " << i;
}

using RecomputeParam = std::tuple<Device, bool, BlockPrecision>;
class TransformerBlockRecomputeTest : public ::testing::TestWithParam<RecomputeParam> {};

TEST_P(TransformerBlockRecomputeTest, GradientsAreBitwiseEqualAndEachPassUpdatesOnce) {
  const auto& [device, llama, precision] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const BlockRun plain = run_block(device, llama, precision, false, seed);
  const BlockRun recomputed = run_block(device, llama, precision, true, seed);
  expect_same_run(plain, recomputed);
  const int64_t expected = precision.recipe ? kMicrobatches : 0;
  for (const BlockRun* run : {&plain, &recomputed}) {
    EXPECT_EQ(run->forward_updates, expected);
    EXPECT_EQ(run->backward_updates, expected);
    for (int64_t n : run->per_state) EXPECT_EQ(n, kMicrobatches);
  }
  // The gradients are real: finite and not all zero.
  bool nonzero = false;
  for (const Tensor& g : plain.grads) {
    for (float v : to_floats(g)) {
      ASSERT_TRUE(std::isfinite(v));
      nonzero |= v != 0.0f;
    }
  }
  EXPECT_TRUE(nonzero);
}

// Backward's recast of the FP8 Linear inputs (Fusion::input_recast) gives the bits of inputs kept
// by the forward, under every recipe, with the fused casts on and off.
TEST_P(TransformerBlockRecomputeTest, RecastInputsAreBitwiseTheKeptOnes) {
  const auto& [device, llama, precision] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const bool fused : {true, false}) {
    SCOPED_TRACE(fused ? "fused casts" : "unfused casts");
    std::vector<Fusion> off;
    if (!fused) off = {Fusion::norm_cast, Fusion::activation_cast, Fusion::activation_grad_cast};
    const UnfusedScope scope(off);
    const BlockRun recast = run_block(device, llama, precision, false, seed);
    off.push_back(Fusion::input_recast);
    const UnfusedScope keep(off);
    expect_same_run(recast, run_block(device, llama, precision, false, seed));
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, TransformerBlockRecomputeTest,
                         ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                                            ::testing::Bool(),
                                            ::testing::ValuesIn(all_precisions())),
                         [](const auto& info) {
                           return device_name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_llama_" : "_gpt2_") +
                                  std::get<2>(info.param).name;
                         });

// ----------------------------------------------------------------------------
// What a training forward keeps

/// Bytes of the activations a block's record holds, each buffer once (the Linear snapshots,
/// which share the layer's weight cast and FP8 scales, are not activations).
int64_t record_bytes(const TransformerBlock::Saved& saved) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  const auto add = [&](const Tensor& t) {
    if (t.defined() && seen.insert(t.raw_data()).second) bytes += static_cast<int64_t>(t.nbytes());
  };
  for (const Tensor* t : {&saved.input, &saved.residual, &saved.attn.qkv_act, &saved.attn.out,
                          &saved.attn.lse, &saved.mlp.hidden})
    add(*t);
  for (const Norm::Saved* n : {&saved.norm1, &saved.norm2}) {
    add(n->input);
    add(n->mean);
    add(n->rstd);
  }
  for (const Linear::Saved* l :
       {&saved.attn.qkv, &saved.attn.proj, &saved.mlp.fc1, &saved.mlp.fc2}) {
    add(l->input);
    for (const Tensor* t :
         {&l->input_q.data, &l->input_q.scale_inv, &l->input_q.data_t, &l->input_q.scale_inv_t})
      add(*t);
  }
  return bytes;
}

// The table of docs/PERFORMANCE.md ("FP8 activation memory") at GPT-2's ffn = 4 dim, in bytes per
// token and unit of width: bf16 32 (x 2, qkv's input 2, q/k/v 6, the attention's output 2, the
// residual 2, fc1's input 2, the activation's input 8 and output 8); FP8 with each Linear's
// transposed FP8 input kept 27 (qkv's, fc1's and fc2's 1 + 1 + 4 instead of 2 + 2 + 8, and
// proj's 1 beside the attention's output); FP8 with all four recast in backward 20.
TEST(TransformerBlockMemory, AnFp8TrainingForwardKeepsNoLinearInput) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  BlockConfig config = block_config(false);
  config.ffn = 4 * kDim;
  const Tensor x = testing::random_tensor({kRows, kDim}, DType::bf16, seed + 1, 2.0f);
  const auto kept = [&](const std::optional<Recipe>& recipe, bool recast) {
    const UnfusedScope scope(recast ? std::vector<Fusion>{} : std::vector{Fusion::input_recast});
    TransformerBlock block(config, Device::cpu(), seed, DType::bf16, false);
    AmaxRegistry registry;
    TransformerBlock::Saved saved;
    if (recipe) {
      Fp8Autocast autocast(*recipe, registry);
      block.forward(x, kBatch, kSeq, saved);
    } else {
      block.forward(x, kBatch, kSeq, saved);
    }
    if (recipe && recast) {
      for (const Linear::Saved* l :
           {&saved.attn.qkv, &saved.attn.proj, &saved.mlp.fc1, &saved.mlp.fc2})
        EXPECT_FALSE(l->filled()) << "neither an FP8 nor a high-precision input";
    }
    return record_bytes(saved);
  };
  // Per token: each norm's mean and rstd, the attention's log-sum-exp per head (f32).
  const int64_t stats = 2 * 2 * 4 + kHeads * 4;
  constexpr int64_t kScaleInv = 4;  // a kept per-tensor FP8 input's f32 scale_inv
  EXPECT_EQ(kept(std::nullopt, true), kRows * (32 * kDim + stats));
  EXPECT_EQ(kept(Recipe::delayed(), false), kRows * (27 * kDim + stats) + 4 * kScaleInv);
  EXPECT_EQ(kept(Recipe::delayed(), true), kRows * (20 * kDim + stats));
}

// ----------------------------------------------------------------------------
// Inference: the current scales, no state change

using RecipeParam = std::tuple<Device, Recipe>;
class TransformerBlockInferenceTest : public ::testing::TestWithParam<RecipeParam> {};

TEST_P(TransformerBlockInferenceTest, LeavesFp8StateAloneAndMatchesATrainingForward) {
  const auto& [device, recipe] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  TransformerBlock block(block_config(false), device, seed, DType::bf16, false);
  AmaxRegistry registry;
  // One training step first, so the delayed scales are no longer 1 and a weight cast is cached.
  const Tensor x0 = testing::random_tensor({kRows, kDim}, DType::bf16, seed + 1, 4.0f).to(device);
  TransformerBlock::Saved saved;
  {
    Fp8Autocast scope(recipe, registry);
    block.forward(x0, kBatch, kSeq, saved);
  }
  block.backward(testing::random_tensor({kRows, kDim}, DType::bf16, seed + 2).to(device), saved);
  registry.finalize_backward();
  block.on_weights_updated();  // as after an optimizer step: inference must cast on its own

  std::vector<Tensor> before;
  std::vector<int64_t> casts;
  for (int s = 0; s < kBlockLinears; ++s) {
    const Linear& l = block.linear(static_cast<LinearSlot>(s));
    for (const Tensor& t : state_tensors(*l.fp8_state())) before.push_back(t.clone());
    casts.push_back(l.weight_casts());
  }
  const Tensor x = testing::random_tensor({kRows, kDim}, DType::bf16, seed + 3).to(device);
  Tensor y_inference;
  {
    AmaxRegistry untouched;
    Fp8Autocast scope(recipe, untouched);
    TransformerBlock::Saved none;
    y_inference = block.forward(x, kBatch, kSeq, none, ForwardMode::inference);
    EXPECT_FALSE(none.input.defined()) << "inference keeps no record";
    EXPECT_TRUE(untouched.states().empty()) << "inference registers nothing";
  }
  size_t k = 0;
  for (int s = 0; s < kBlockLinears; ++s) {
    const Linear& l = block.linear(static_cast<LinearSlot>(s));
    for (const Tensor& t : state_tensors(*l.fp8_state()))
      EXPECT_TRUE(bitwise_equal(before[k++], t)) << "linear " << s;
    EXPECT_EQ(l.weight_casts(), casts[static_cast<size_t>(s)]) << "linear " << s;
    EXPECT_FALSE(l.fp8_state()->pending(Pass::forward));
  }
  EXPECT_EQ(registry.forward_update_count(), 1);

  // A training forward now uses the same scales, so it computes the same output.
  TransformerBlock::Saved trained;
  Tensor y_train;
  {
    Fp8Autocast scope(recipe, registry);
    y_train = block.forward(x, kBatch, kSeq, trained);
  }
  EXPECT_TRUE(bitwise_equal(y_train, y_inference));
}

INSTANTIATE_TEST_SUITE_P(Recipes, TransformerBlockInferenceTest,
                         ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                                            ::testing::ValuesIn(all_recipes())),
                         [](const auto& info) {
                           std::string name = device_name(std::get<0>(info.param)) + "_" +
                                              std::get<1>(info.param).name();
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// ----------------------------------------------------------------------------
// Observer, errors

TEST(TransformerBlockObserver, SeesEveryLinearInputOfATrainingForwardInOrder) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  TransformerBlock block(block_config(true), Device::cpu(), seed, DType::f32, false);
  std::vector<LinearSlot> slots;
  std::vector<Shape> shapes;
  std::vector<bool> filled;
  const LinearObserver observer = [&](LinearSlot slot, const Tensor& input,
                                      const Linear::Saved& saved) {
    slots.push_back(slot);
    shapes.push_back(input.shape());
    filled.push_back(saved.filled());
  };
  const Tensor x = testing::random_tensor({kRows, kDim}, DType::f32, seed);
  TransformerBlock::Saved saved;
  block.forward(x, kBatch, kSeq, saved, ForwardMode::normal, &observer);
  EXPECT_EQ(slots, (std::vector<LinearSlot>{LinearSlot::qkv, LinearSlot::proj, LinearSlot::fc1,
                                            LinearSlot::fc2}));
  EXPECT_EQ(shapes,
            (std::vector<Shape>{{kRows, kDim}, {kRows, kDim}, {kRows, kDim}, {kRows, kFfn}}));
  EXPECT_EQ(filled, std::vector<bool>(kBlockLinears, true));
  TransformerBlock::Saved none;
  block.forward(x, kBatch, kSeq, none, ForwardMode::inference, &observer);
  EXPECT_EQ(slots.size(), static_cast<size_t>(kBlockLinears)) << "inference is not observed";
}

TEST(TransformerBlockErrors, BadInputsAndRecordsAreRejectedWithTheReason) {
  TransformerBlock block(block_config(false), Device::cpu(), fresh_seed(), DType::f32, true);
  TransformerBlock::Saved saved;
  EXPECT_THAT(
      [&] {
        block.forward(Tensor::zeros({kRows, kDim + 1}, DType::f32), kBatch, kSeq, saved);
      },
      ::testing::ThrowsMessage<Error>(
          HasSubstr("expects x [batch*seq, dim] = [16, 32], got f32[16, 33]")));
  EXPECT_THAT(
      [&] {
        block.forward(Tensor::zeros({kRows, kDim}, DType::f32), kBatch, kSeq, saved,
                      ForwardMode::recompute);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("recompute happens inside backward")));
  EXPECT_THAT(
      [&] {
        block.backward(Tensor::zeros({kRows, kDim}, DType::f32), saved);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("needs the Saved of a training forward")));
  const Tensor x = testing::random_tensor({kRows, kDim}, DType::f32, fresh_seed());
  block.forward(x, kBatch, kSeq, saved);
  EXPECT_THAT(
      [&] {
        block.backward(Tensor::zeros({kRows, kDim}, DType::bf16), saved);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("expects dy like its input")));
}

TEST(LinearInference, NeedsAStateForTheRecipeAndItsSavedCannotGoBackward) {
  Linear layer(32, 16, true, Device::cpu(), fresh_seed(), DType::bf16);
  const Tensor x = testing::random_tensor({16, 32}, DType::bf16, fresh_seed());
  AmaxRegistry registry;
  Linear::Saved saved;
  EXPECT_THAT(
      [&] {
        Fp8Autocast scope(Recipe::delayed(), registry);
        layer.forward(x, saved, ForwardMode::inference);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("needs the layer's FP8 state for that recipe")));
  const FP8State& state = layer.ensure_fp8_state(Recipe::delayed());
  EXPECT_EQ(&state, layer.fp8_state().get());
  EXPECT_EQ(&layer.ensure_fp8_state(Recipe::delayed()), &state) << "an existing state is kept";
  {
    Fp8Autocast scope(Recipe::delayed(), registry);
    layer.forward(x, saved, ForwardMode::inference);
  }
  EXPECT_FALSE(saved.input_q.has_columnwise()) << "inference quantizes only what its GEMM reads";
  EXPECT_EQ(layer.weight_casts(), 0);
  EXPECT_THAT(
      [&] {
        layer.backward(Tensor::zeros({16, 16}, DType::bf16), saved);
      },
      ::testing::ThrowsMessage<Error>(HasSubstr("got one of an inference forward")));
}

// ----------------------------------------------------------------------------
// A norm feeding a Linear (norm_linear_forward / norm_linear_backward: TE's LayerNormLinear)

/// Gains in [0.5, 1.5] and shifts in [-0.5, 0.5] drawn from `seed`, so that a swapped or unused
/// gamma or beta shows.
void set_norm_parameters(const Norm& norm, uint64_t seed) {
  std::vector<float> gamma = to_floats(testing::random_tensor({kDim}, DType::f32, seed + 1, 0.5f));
  for (float& g : gamma) g += 1.0f;
  Tensor g = norm.gamma(), b = norm.beta();  // handles on the norm's storage
  g.copy_from(Tensor::from_vector(gamma, {kDim}).to(g.device()));
  if (b.defined())
    b.copy_from(testing::random_tensor({kDim}, DType::f32, seed + 2, 0.5f).to(b.device()));
}

struct NormLinearRun {
  std::vector<Tensor> tensors;  ///< y and dx of every microbatch, then every gradient and FP8 state
};

/// kMicrobatches through a norm over kDim and a Linear kDim -> kFfn (norm_linear_forward) or, with
/// `mlp`, an MLP kDim -> kFfn -> kDim with that activation (norm_mlp_forward), on [kBatch, kSeq,
/// kDim] inputs; with `recompute`, backward takes a record rebuilt by a recompute forward.
NormLinearRun run_norm_linear(const Device& device, NormKind kind, const BlockPrecision& p,
                              bool recompute, uint64_t seed,
                              std::optional<ops::Activation> mlp = std::nullopt) {
  Norm norm(kind, kDim, 1e-5f, device);
  Linear fc1(kDim, mlp ? ops::activation_input_cols(*mlp, kFfn) : kFfn, /*bias=*/true, device,
             seed, p.activation);
  std::optional<Linear> fc2;
  if (mlp) fc2.emplace(kFfn, kDim, /*bias=*/true, device, seed + 1, p.activation);
  const int64_t out_cols = mlp ? kDim : kFfn;
  set_norm_parameters(norm, seed);
  AmaxRegistry registry;
  NormLinearRun run;
  for (int m = 0; m < kMicrobatches; ++m) {
    const uint64_t mb = seed + 7919 * (m + 1);
    const Tensor x =
        testing::random_tensor({kBatch, kSeq, kDim}, p.activation, mb, 2.0f).to(device);
    const Tensor dy =
        testing::random_tensor({kBatch, kSeq, out_cols}, p.activation, mb + 1).to(device);
    std::optional<Fp8Autocast> scope;
    if (p.recipe) scope.emplace(*p.recipe, registry);
    // Delayed scaling fuses from the second microbatch on (the first needs the input's own amax),
    // unless Fusion::norm_cast is off.
    if (p.recipe && p.recipe->kind == fp8::RecipeKind::delayed && m > 0)
      EXPECT_TRUE(fc1.takes_fused_input(Linear::Saved{})) << "microbatch " << m;
    Norm::Saved norm_saved;
    Linear::Saved saved;
    MLP::Saved mlp_saved;
    const auto forward = [&](Norm::Saved& ns, Linear::Saved& ls, MLP::Saved& ms, ForwardMode mode) {
      return mlp ? norm_mlp_forward(norm, *mlp, fc1, *fc2, x, ns, ms, mode)
                 : norm_linear_forward(norm, fc1, x, ns, ls, mode);
    };
    const Tensor y = forward(norm_saved, saved, mlp_saved, ForwardMode::normal);
    EXPECT_EQ(y.shape(), (Shape{kBatch, kSeq, out_cols}));
    if (recompute) {
      Linear::Saved rebuilt = Linear::Saved::from_snapshot(saved.snapshot);
      MLP::Saved mlp_rebuilt;
      mlp_rebuilt.fc1 = Linear::Saved::from_snapshot(mlp_saved.fc1.snapshot);
      mlp_rebuilt.fc2 = Linear::Saved::from_snapshot(mlp_saved.fc2.snapshot);
      Norm::Saved norm_rebuilt;
      const Tensor again = forward(norm_rebuilt, rebuilt, mlp_rebuilt, ForwardMode::recompute);
      EXPECT_TRUE(bitwise_equal(y, again)) << "recomputed y, microbatch " << m;
      saved = std::move(rebuilt);
      mlp_saved = std::move(mlp_rebuilt);
      norm_saved = std::move(norm_rebuilt);
    }
    scope.reset();
    const Tensor dx = mlp ? norm_mlp_backward(norm, *mlp, fc1, *fc2, dy, norm_saved, mlp_saved)
                          : norm_linear_backward(norm, fc1, dy, norm_saved, saved);
    EXPECT_EQ(dx.shape(), x.shape());
    if (p.recipe) registry.finalize_backward();
    run.tensors.push_back(y.to(Device::cpu()));
    run.tensors.push_back(dx.to(Device::cpu()));
  }
  std::vector<const Linear*> layers{&fc1};
  if (fc2) layers.push_back(&*fc2);
  for (const Linear* l : layers)
    for (const Tensor* g : {&l->grad_weight(), &l->grad_bias()})
      run.tensors.push_back(g->to(Device::cpu()));
  run.tensors.push_back(norm.grad_gamma().to(Device::cpu()));
  if (kind == NormKind::layernorm) run.tensors.push_back(norm.grad_beta().to(Device::cpu()));
  if (p.recipe)
    for (const Linear* l : layers)
      for (const Tensor& t : state_tensors(*l->fp8_state()))
        run.tensors.push_back(t.to(Device::cpu()));
  return run;
}

void expect_same_tensors(const NormLinearRun& a, const NormLinearRun& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i)
    EXPECT_TRUE(bitwise_equal(a.tensors[i], b.tensors[i])) << "tensor " << i;
}

/// Runs the norm and its module (as run_norm_linear) with every fused cast, with `fusions` off and
/// with recompute, expecting bitwise the same tensors; returns the fused run.
NormLinearRun expect_fusions_and_recompute_change_nothing(
    const Device& device, NormKind kind, const BlockPrecision& p, uint64_t seed,
    const std::vector<Fusion>& fusions, std::optional<ops::Activation> mlp = std::nullopt) {
  const NormLinearRun fused = run_norm_linear(device, kind, p, false, seed, mlp);
  {
    const UnfusedScope off(fusions);
    expect_same_tensors(fused, run_norm_linear(device, kind, p, false, seed, mlp));
  }
  expect_same_tensors(fused, run_norm_linear(device, kind, p, true, seed, mlp));
  return fused;
}

using NormLinearParam = std::tuple<Device, NormKind, BlockPrecision>;
class NormLinearTest : public ::testing::TestWithParam<NormLinearParam> {};

/// The norm writing the Linear's FP8 input (delayed scaling, from the second microbatch on) gives
/// bitwise what the norm's output cast by the Linear gives, under every precision; a recompute
/// rebuilds the record bit for bit; and the result is the composition itself, within f32's
/// rounding for f32 (the FP8 runs' accuracy is the Linear's, tested in linear_test.cc).
TEST_P(NormLinearTest, FusedCastIsBitwiseTheUnfusedAndRecomputeTheOriginal) {
  const auto& [device, kind, precision] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const NormLinearRun fused =
      expect_fusions_and_recompute_change_nothing(device, kind, precision, seed,
                                                  {Fusion::norm_cast});
  if (precision.activation != DType::f32 || precision.recipe) return;
  // f32: y against the norm and the Linear run apart.
  Norm norm(kind, kDim, 1e-5f, device);
  Linear linear(kDim, kFfn, true, device, seed, DType::f32);
  set_norm_parameters(norm, seed);
  const Tensor x =
      testing::random_tensor({kBatch, kSeq, kDim}, DType::f32, seed + 7919, 2.0f).to(device);
  Norm::Saved norm_saved;
  Linear::Saved saved;
  const Tensor h = norm.forward(x, norm_saved);
  EXPECT_TRUE(bitwise_equal(linear.forward(h, saved), fused.tensors[0].to(device)));
}

INSTANTIATE_TEST_SUITE_P(Precisions, NormLinearTest,
                         ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                                            ::testing::Values(NormKind::layernorm,
                                                              NormKind::rmsnorm),
                                            ::testing::ValuesIn(all_precisions())),
                         [](const auto& info) {
                           return device_name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == NormKind::layernorm ? "_layernorm_"
                                                                                  : "_rmsnorm_") +
                                  std::get<2>(info.param).name;
                         });

// A norm feeding an MLP (norm_mlp_forward / norm_mlp_backward: TE's LayerNormMLP)

using NormMlpParam = std::tuple<Device, std::pair<NormKind, ops::Activation>, BlockPrecision>;
class NormMlpTest : public ::testing::TestWithParam<NormMlpParam> {};

/// With the norm writing fc1's FP8 input, the activation fc2's and the activation's backward
/// fc1's FP8 gradient, every tensor is bitwise what the unfused path gives, under every precision;
/// a recompute rebuilds the record bit for bit; and the f32 result is nn::MLP's after the norm.
TEST_P(NormMlpTest, FusedCastsAreBitwiseTheUnfusedAndRecomputeTheOriginal) {
  const auto& [device, kinds, precision] = GetParam();
  const auto [kind, activation] = kinds;
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const NormLinearRun fused = expect_fusions_and_recompute_change_nothing(
      device, kind, precision, seed,
      {Fusion::norm_cast, Fusion::activation_cast, Fusion::activation_grad_cast}, activation);
  if (precision.activation != DType::f32 || precision.recipe) return;
  // f32: y against the norm and mlp_forward run apart.
  Norm norm(kind, kDim, 1e-5f, device);
  Linear fc1(kDim, ops::activation_input_cols(activation, kFfn), true, device, seed, DType::f32);
  Linear fc2(kFfn, kDim, true, device, seed + 1, DType::f32);
  set_norm_parameters(norm, seed);
  const Tensor x =
      testing::random_tensor({kBatch, kSeq, kDim}, DType::f32, seed + 7919, 2.0f).to(device);
  Norm::Saved norm_saved;
  MLP::Saved saved;
  const Tensor h = norm.forward(x, norm_saved).view({-1, kDim});
  const Tensor y = mlp_forward(activation, fc1, fc2, h, saved);
  EXPECT_TRUE(bitwise_equal(y, fused.tensors[0].to(device).view({-1, kDim})));
}

INSTANTIATE_TEST_SUITE_P(
    Precisions, NormMlpTest,
    ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                       ::testing::Values(std::pair{NormKind::layernorm, ops::Activation::gelu},
                                         std::pair{NormKind::rmsnorm, ops::Activation::swiglu},
                                         std::pair{NormKind::layernorm, ops::Activation::srelu}),
                       ::testing::ValuesIn(all_precisions())),
    [](const auto& info) {
      const auto& kinds = std::get<1>(info.param);
      return device_name(std::get<0>(info.param)) +
             (kinds.first == NormKind::layernorm ? "_layernorm_" : "_rmsnorm_") +
             ops::activation_name(kinds.second) + "_" + std::get<2>(info.param).name;
    });

TEST(NormLinear, RefusesAnInputOfAnotherWidth) {
  Norm norm(NormKind::layernorm, kDim, 1e-5f, Device::cpu());
  Linear linear(kDim, kFfn, true, Device::cpu(), 1);
  Norm::Saved norm_saved;
  Linear::Saved saved;
  const Tensor x = testing::random_tensor({kRows, kDim + 1}, DType::f32, 3);
  EXPECT_THAT([&] { norm_linear_forward(norm, linear, x, norm_saved, saved); },
              ::testing::ThrowsMessage<Error>(HasSubstr("expects an input [..., 32]")));
}

}  // namespace
}  // namespace octet::nn
