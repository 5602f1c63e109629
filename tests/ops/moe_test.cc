// The MoE ops (router, plan, dispatch/combine, scaled activation): the CPU reference against
// independent test-local semantics and central differences, CUDA against the CPU (bit-exact where
// both perform the same IEEE operations; stated tolerances where exp/tanh differ by an ulp), empty
// experts and very uneven splits, bad inputs, and byte-for-byte repeatability on the GPU at the
// field shape of FIELD-NOTES section 3.
#include "octet/ops/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "octet/core/cuda_context.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using ops::MoeActivation;
using ops::MoePlan;
using ops::RouterArgs;
using ops::RouterOutputs;
using ops::RouterScoring;
using testing::bitwise_equal;
using testing::fresh_seed;
using testing::make_tensor;
using testing::on;
using testing::to_floats;

const Device kCpu = Device::cpu();
const Device kGpu = Device::cuda(0);

/// How the test draws which experts tokens go to.
enum class Split { random, two_of_sixteen_take_half, all_on_one };

/// i32 [tokens, topk] with distinct experts per token, drawn per `split` from `rng`; experts 3..
/// stay empty under all_on_one (topk 1) and most stay nearly empty under two_of_sixteen.
Tensor draw_experts(int64_t tokens, int64_t topk, int64_t experts, Split split,
                    std::mt19937_64& rng) {
  Tensor t = Tensor::empty({tokens, topk}, DType::i32);
  int32_t* e = t.data<int32_t>();
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t s = 0; s < topk; ++s) {
      int32_t pick;
      do {
        if (split == Split::all_on_one) {
          pick = static_cast<int32_t>((5 + s) % experts);
        } else if (split == Split::two_of_sixteen_take_half && s == 0 && i % 2 == 0) {
          pick = static_cast<int32_t>(rng() % 2);
        } else {
          pick = static_cast<int32_t>(rng() % experts);
        }
      } while (std::find(e + i * topk, e + i * topk + s, pick) != e + i * topk + s);
      e[i * topk + s] = pick;
    }
  }
  return t;
}

/// f32 tensor with values uniform in [lo, hi] (never 0).
Tensor uniform(const Shape& shape, float lo, float hi, std::mt19937_64& rng,
               DType dtype = DType::f32) {
  return make_tensor(testing::uniform_values(shape_numel(shape), lo, hi, rng), shape, dtype);
}

std::vector<int32_t> ints(const Tensor& t) {
  const std::vector<uint8_t> bytes = testing::to_bytes(t);
  std::vector<int32_t> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

/// Passes when |got - ref| <= rel * max|ref| for every element (a tolerance for values whose
/// exp/tanh the host and the device may round an ulp apart).
::testing::AssertionResult close_rel(const Tensor& got, const Tensor& ref, double rel) {
  const std::vector<float> g = to_floats(got), r = to_floats(ref);
  double scale = 0.0;
  for (float v : r) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  for (size_t i = 0; i < g.size(); ++i)
    if (!(std::fabs(static_cast<double>(g[i]) - r[i]) <= rel * scale))
      return ::testing::AssertionFailure() << "element " << i << ": got " << g[i] << ", expected "
                                           << r[i] << " (bound " << rel * scale << ")";
  return ::testing::AssertionSuccess();
}

// ----------------------------------------------------------------------------
// Router

RouterArgs router_args(RouterScoring scoring, int64_t topk, int64_t experts, std::mt19937_64& rng) {
  RouterArgs args;
  args.scoring = scoring;
  args.topk = topk;
  args.aux_loss_coef = 0.01f;
  args.z_loss_coef = 0.001f;
  if (scoring == RouterScoring::sigmoid) args.selection_bias = uniform({experts}, -0.2f, 0.2f, rng);
  return args;
}

RouterArgs args_on(RouterArgs args, const Device& device) {
  if (args.selection_bias.defined()) args.selection_bias = on(args.selection_bias, device);
  return args;
}

RouterOutputs run_router(const Tensor& logits, const RouterArgs& args, const Device& device) {
  RouterOutputs out =
      RouterOutputs::allocate(logits.rows(), logits.cols(), args.topk, device);
  ops::router_forward(on(logits, device), args_on(args, device), out);
  return out;
}

class RouterTest : public ::testing::TestWithParam<RouterScoring> {};

/// The CPU reference against the definition: each token's experts are its k largest keys (lower
/// index first on ties), its probs the renormalised scores, the counts their histogram, and the
/// aux and z losses their formulas in double.
TEST_P(RouterTest, CpuMatchesDefinition) {
  std::mt19937_64 rng(fresh_seed());
  const int64_t tokens = 97, experts = 16, topk = 2;
  Tensor logits = uniform({tokens, experts}, -3.0f, 3.0f, rng);
  logits.data<float>()[3 * experts + 7] = logits.data<float>()[3 * experts + 2] = 9.0f;  // a tie
  const RouterArgs args = router_args(GetParam(), topk, experts, rng);
  if (args.selection_bias.defined())  // equal, largest biases: the tie is the top selection key
    args.selection_bias.data<float>()[7] = args.selection_bias.data<float>()[2] = 0.2f;
  const RouterOutputs out = run_router(logits, args, kCpu);
  const float* l = logits.data<float>();
  std::vector<int> counts(experts, 0);
  double aux_sum = 0.0, z_sum = 0.0;
  std::vector<double> score_sum(experts, 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    double m = -INFINITY, sum = 0.0;
    for (int64_t e = 0; e < experts; ++e) m = std::max(m, static_cast<double>(l[t * experts + e]));
    for (int64_t e = 0; e < experts; ++e) sum += std::exp(l[t * experts + e] - m);
    const double lse = m + std::log(sum);
    z_sum += lse * lse;
    std::vector<double> score(experts), key(experts);
    for (int64_t e = 0; e < experts; ++e) {
      const double x = l[t * experts + e];
      score[e] = GetParam() == RouterScoring::softmax ? std::exp(x - lse) : 1.0 / (1.0 + std::exp(-x));
      key[e] = GetParam() == RouterScoring::softmax
                   ? x
                   : score[e] + args.selection_bias.data<float>()[e];
      score_sum[e] += score[e];
    }
    std::vector<int> order(experts);
    for (int e = 0; e < experts; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key[a] > key[b]; });
    double selected = 0.0;
    for (int64_t s = 0; s < topk; ++s) selected += score[order[s]];
    for (int64_t s = 0; s < topk; ++s) {
      ASSERT_EQ(out.expert.data<int32_t>()[t * topk + s], order[s]) << "token " << t;
      EXPECT_NEAR(out.prob.data<float>()[t * topk + s], score[order[s]] / selected, 1e-6);
      ++counts[order[s]];
    }
  }
  for (int64_t e = 0; e < experts; ++e) {
    EXPECT_EQ(out.counts.data<int32_t>()[e], counts[e]);
    aux_sum += static_cast<double>(counts[e]) / (tokens * topk) * score_sum[e] / tokens;
  }
  EXPECT_NEAR(out.aux_loss.data<float>()[0], args.aux_loss_coef * experts * aux_sum, 1e-6);
  EXPECT_NEAR(out.z_loss.data<float>()[0], args.z_loss_coef * z_sum / tokens, 1e-6);
  EXPECT_EQ(out.expert.data<int32_t>()[3 * topk], 2) << "a tie goes to the lower expert index";
}

/// L = sum w * prob + aux_loss + z_loss against central differences in the logits.
TEST_P(RouterTest, BackwardMatchesCentralDifferences) {
  std::mt19937_64 rng(fresh_seed());
  const int64_t tokens = 24, experts = 6, topk = 2;
  // Each token's logits are distinct levels kLevelGap apart (plus a little jitter), and the
  // selection biases tiny, so that no step of the difference changes which experts are chosen
  // (the gate is discontinuous where two keys cross).
  constexpr float kLevelGap = 0.5f, kJitter = 0.05f, kBias = 0.005f;
  Tensor logits = Tensor::empty({tokens, experts}, DType::f32);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int> level(experts);
    for (int e = 0; e < experts; ++e) level[e] = e;
    std::shuffle(level.begin(), level.end(), rng);
    const std::vector<float> jitter = testing::uniform_values(experts, -kJitter, kJitter, rng);
    for (int64_t e = 0; e < experts; ++e)
      logits.data<float>()[t * experts + e] = -2.0f + kLevelGap * level[e] + jitter[e];
  }
  RouterArgs args = router_args(GetParam(), topk, experts, rng);
  if (args.selection_bias.defined()) args.selection_bias = uniform({experts}, -kBias, kBias, rng);
  args.aux_loss_coef = 0.5f;  // large enough to stand out of the central difference's noise
  args.z_loss_coef = 0.1f;
  const Tensor w = uniform({tokens, topk}, -1.0f, 1.0f, rng);
  const RouterOutputs saved = run_router(logits, args, kCpu);
  const Tensor dlogits = Tensor::empty({tokens, experts}, DType::f32);
  ops::router_backward(logits, args, saved, w, dlogits);
  std::vector<float> weights = to_floats(w);
  weights.push_back(1.0f);  // aux_loss
  weights.push_back(1.0f);  // z_loss
  const auto forward = [&] {
    const RouterOutputs o = run_router(logits, args, kCpu);
    std::vector<float> v = to_floats(o.prob);
    v.push_back(o.aux_loss.data<float>()[0]);
    v.push_back(o.z_loss.data<float>()[0]);
    return v;
  };
  EXPECT_TRUE(testing::matches_central_differences(logits, forward, weights, to_floats(dlogits),
                                                   1e-2f, 2e-3, 1e-2));
}

/// CUDA = CPU: experts and counts exactly; scores, probs, losses and dlogits within 1e-5 of
/// max|CPU| (the host's and the device's expf/logf may round an ulp apart).
TEST_P(RouterTest, CudaMatchesCpu) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  std::mt19937_64 rng(fresh_seed());
  for (int64_t tokens : {1, 333, 4099}) {
    const int64_t experts = 16, topk = tokens == 1 ? 1 : 2;
    SCOPED_TRACE(tokens);
    const Tensor logits = uniform({tokens, experts}, -4.0f, 4.0f, rng);
    const RouterArgs args = router_args(GetParam(), topk, experts, rng);
    const RouterOutputs cpu = run_router(logits, args, kCpu);
    const RouterOutputs gpu = run_router(logits, args, kGpu);
    EXPECT_TRUE(bitwise_equal(cpu.expert, gpu.expert)) << "expert";
    EXPECT_TRUE(bitwise_equal(cpu.counts, gpu.counts)) << "counts";
    EXPECT_TRUE(close_rel(gpu.scores, cpu.scores, 1e-5)) << "scores";
    EXPECT_TRUE(close_rel(gpu.prob, cpu.prob, 1e-5)) << "prob";
    EXPECT_TRUE(close_rel(gpu.aux_loss, cpu.aux_loss, 1e-5)) << "aux_loss";
    EXPECT_TRUE(close_rel(gpu.z_loss, cpu.z_loss, 1e-5)) << "z_loss";
    const Tensor dprob = uniform({tokens, topk}, -1.0f, 1.0f, rng);
    const Tensor d_cpu = Tensor::empty({tokens, experts}, DType::f32);
    const Tensor d_gpu = Tensor::empty({tokens, experts}, DType::f32, kGpu);
    ops::router_backward(logits, args, cpu, dprob, d_cpu);
    ops::router_backward(on(logits, kGpu), args_on(args, kGpu), gpu, on(dprob, kGpu), d_gpu);
    EXPECT_TRUE(close_rel(d_gpu, d_cpu, 1e-5)) << "dlogits";
  }
}

TEST(RouterErrors, TopkAboveExpertsAndBiasWithSoftmax) {
  std::mt19937_64 rng(fresh_seed());
  const Tensor logits = uniform({4, 3}, -1.0f, 1.0f, rng);
  RouterArgs args;
  args.topk = 4;
  testing::expect_error([&] { run_router(logits, args, kCpu); }, {"topk must be in [1, experts = 3]"});
  args.topk = 2;
  args.selection_bias = uniform({3}, -1.0f, 1.0f, rng);
  testing::expect_error([&] { run_router(logits, args, kCpu); }, {"selection_bias", "sigmoid"});
}

INSTANTIATE_TEST_SUITE_P(Ops, RouterTest,
                         ::testing::Values(RouterScoring::softmax, RouterScoring::sigmoid),
                         [](const auto& info) { return ops::router_scoring_name(info.param); });

// ----------------------------------------------------------------------------
// Plan, dispatch and combine

struct SplitCase {
  Split split;
  int64_t tokens, topk, experts, dim;
  const char* name;
};
const SplitCase kSplits[] = {
    {Split::random, 333, 2, 16, 67, "random"},
    {Split::two_of_sixteen_take_half, 512, 2, 16, 64, "half_on_two_of_16"},
    {Split::all_on_one, 100, 1, 16, 33, "all_on_one_of_16"},
    // Rows of several 16-byte-pack chunks (2048 bf16 / 1024 f32 per CTA pass) with a partial last
    // one, and top-5 (more slots than a thread loads at once): 2600 packs, 1299 does not, while
    // the activation tests' F = 2 dim + 2 gives the opposite (5202 and 2600). 24 experts: more
    // than one launch of the fused cast's tile group takes (16).
    {Split::random, 40, 5, 24, 2600, "wide_top5_of_24"},
    {Split::two_of_sixteen_take_half, 64, 2, 16, 1299, "wide_half_on_two_of_16"},
    // bf16 rows of whole packs over two whole 128-column tiles and a partial one, groups of one
    // and two 128-row tiles, and 40 experts: more than one launch of the per-tensor FP8 cast (32).
    {Split::two_of_sixteen_take_half, 256, 2, 40, 264, "half_on_two_of_40"},
    // The staged combine (rows of 16-byte packs, top-1 or top-2, two tokens a CTA) with an odd
    // token count, so its last CTA owns one token, top-1, and rows of several passes of its
    // threads (2056 columns: two in bf16, three in f32).
    {Split::all_on_one, 101, 1, 16, 2056, "odd_tokens_top1_wide"},
};

MoePlan make_plan(const Tensor& expert, int64_t experts, const Device& device) {
  MoePlan plan = MoePlan::allocate(expert.size(0), expert.size(1), experts, device);
  ops::moe_plan(on(expert, device), plan);
  return plan;
}

class MoeLayoutTest : public ::testing::TestWithParam<SplitCase> {};

/// The plan is the stable, padded, expert-contiguous layout: checked against a sort in the test.
TEST_P(MoeLayoutTest, PlanIsStablePaddedAndExpertContiguous) {
  const SplitCase& c = GetParam();
  std::mt19937_64 rng(fresh_seed());
  const Tensor expert = draw_experts(c.tokens, c.topk, c.experts, c.split, rng);
  const MoePlan plan = make_plan(expert, c.experts, kCpu);
  const std::vector<int32_t> e = ints(expert), off = ints(plan.offsets), map = ints(plan.row_map),
                             slot_row = ints(plan.slot_row);
  ASSERT_EQ(off[0], 0);
  int64_t row = 0;
  for (int64_t x = 0; x < c.experts; ++x) {
    ASSERT_EQ(off[x], row);
    int64_t n = 0;
    for (int64_t i = 0; i < c.tokens * c.topk; ++i)
      if (e[i] == x) {  // slots of x in (token, slot) order
        ASSERT_EQ(slot_row[i], row + n);
        ASSERT_EQ(map[2 * (row + n)], i / c.topk);
        ASSERT_EQ(map[2 * (row + n) + 1], i % c.topk);
        ++n;
      }
    const int64_t padded = (n + ops::kMoeGroupAlign - 1) / ops::kMoeGroupAlign * ops::kMoeGroupAlign;
    for (int64_t r = row + n; r < row + padded; ++r) ASSERT_EQ(map[2 * r], -1);
    row += padded;
  }
  ASSERT_EQ(off[c.experts], row);
  for (int64_t r = row; r < plan.capacity(); ++r) ASSERT_EQ(map[2 * r], -1);
}

/// dispatch copies rows and zeroes padding; combine and both backwards equal their sums written
/// out here in the same order (so exactly).
TEST_P(MoeLayoutTest, DispatchCombineAndBackwardsMatchTheirSums) {
  const SplitCase& c = GetParam();
  std::mt19937_64 rng(fresh_seed());
  const Tensor expert = draw_experts(c.tokens, c.topk, c.experts, c.split, rng);
  const MoePlan plan = make_plan(expert, c.experts, kCpu);
  const std::vector<int32_t> slot_row = ints(plan.slot_row), map = ints(plan.row_map);
  const int64_t cap = plan.capacity(), dim = c.dim;
  const Tensor x = uniform({c.tokens, dim}, -1.0f, 1.0f, rng);
  const Tensor permuted = Tensor::empty({cap, dim}, DType::f32);
  ops::moe_dispatch(x, plan, permuted);
  const Tensor prob = uniform({c.tokens, c.topk}, 0.05f, 1.0f, rng);
  const Tensor expert_out = uniform({cap, dim}, -1.0f, 1.0f, rng);
  const Tensor y = Tensor::empty({c.tokens, dim}, DType::f32);
  ops::moe_combine(expert_out, prob, plan, y);
  const Tensor dy = uniform({c.tokens, dim}, -1.0f, 1.0f, rng);
  const Tensor d_out = Tensor::empty({cap, dim}, DType::f32);
  const Tensor dprob = Tensor::empty({c.tokens, c.topk}, DType::f32);
  ops::moe_combine_backward(dy, expert_out, prob, plan, d_out, dprob);
  const Tensor dx = Tensor::empty({c.tokens, dim}, DType::f32);
  ops::moe_dispatch_backward(expert_out, plan, dx);
  const float *xv = x.data<float>(), *pv = prob.data<float>(), *eo = expert_out.data<float>(),
              *g = dy.data<float>();
  for (int64_t r = 0; r < cap; ++r)
    for (int64_t j = 0; j < dim; ++j) {
      const int32_t t = map[2 * r];
      ASSERT_EQ(permuted.data<float>()[r * dim + j], t < 0 ? 0.0f : xv[t * dim + j]);
      ASSERT_EQ(d_out.data<float>()[r * dim + j],
                t < 0 ? 0.0f : pv[t * c.topk + map[2 * r + 1]] * g[t * dim + j]);
    }
  for (int64_t t = 0; t < c.tokens; ++t)
    for (int64_t j = 0; j < dim; ++j) {
      float sum = 0.0f, grad = 0.0f;
      for (int64_t s = 0; s < c.topk; ++s) {
        sum += pv[t * c.topk + s] * eo[slot_row[t * c.topk + s] * dim + j];
        grad += eo[slot_row[t * c.topk + s] * dim + j];
      }
      ASSERT_EQ(y.data<float>()[t * dim + j], sum);
      ASSERT_EQ(dx.data<float>()[t * dim + j], grad);
    }
  for (int64_t i = 0; i < c.tokens * c.topk; ++i) {
    double dot = 0.0;
    for (int64_t j = 0; j < dim; ++j)
      dot += static_cast<double>(g[(i / c.topk) * dim + j]) * eo[slot_row[i] * dim + j];
    EXPECT_NEAR(dprob.data<float>()[i], dot, 1e-5 * dim);
  }
}

/// CUDA = CPU bit for bit: the plan, dispatch, combine, their backwards, and the prob gather and
/// scatter, in f32 and bf16.
TEST_P(MoeLayoutTest, CudaMatchesCpuBitwise) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  const SplitCase& c = GetParam();
  std::mt19937_64 rng(fresh_seed());
  const Tensor expert = draw_experts(c.tokens, c.topk, c.experts, c.split, rng);
  const MoePlan cpu = make_plan(expert, c.experts, kCpu), gpu = make_plan(expert, c.experts, kGpu);
  EXPECT_TRUE(bitwise_equal(cpu.offsets, gpu.offsets)) << "offsets";
  EXPECT_TRUE(bitwise_equal(cpu.row_map, gpu.row_map)) << "row_map";
  EXPECT_TRUE(bitwise_equal(cpu.slot_row, gpu.slot_row)) << "slot_row";
  const int64_t cap = cpu.capacity(), dim = c.dim;
  const Tensor prob = uniform({c.tokens, c.topk}, 0.05f, 1.0f, rng);
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = uniform({c.tokens, dim}, -1.0f, 1.0f, rng, dtype);
    const Tensor eo = uniform({cap, dim}, -1.0f, 1.0f, rng, dtype);
    const Tensor dy = uniform({c.tokens, dim}, -1.0f, 1.0f, rng, dtype);
    const auto both = [&](const Shape& shape, DType t, auto&& run) {
      const Tensor a = Tensor::empty(shape, t), b = Tensor::empty(shape, t, kGpu);
      run(cpu, a, kCpu);
      run(gpu, b, kGpu);
      return bitwise_equal(a, b);
    };
    EXPECT_TRUE(both({cap, dim}, dtype, [&](const MoePlan& p, const Tensor& o, const Device& d) {
      ops::moe_dispatch(on(x, d), p, o);
    })) << "dispatch";
    EXPECT_TRUE(both({c.tokens, dim}, dtype, [&](const MoePlan& p, const Tensor& o, const Device& d) {
      ops::moe_dispatch_backward(on(eo, d), p, o);
    })) << "dispatch backward";
    for (bool weighted : {true, false}) {
      const auto pr = [&](const Device& d) { return weighted ? on(prob, d) : Tensor(); };
      EXPECT_TRUE(both({c.tokens, dim}, dtype, [&](const MoePlan& p, const Tensor& o, const Device& d) {
        ops::moe_combine(on(eo, d), pr(d), p, o);
      })) << "combine, weighted " << weighted;
    }
    const Tensor dprob_cpu = Tensor::empty({c.tokens, c.topk}, DType::f32);
    const Tensor dprob_gpu = Tensor::empty({c.tokens, c.topk}, DType::f32, kGpu);
    EXPECT_TRUE(both({cap, dim}, dtype, [&](const MoePlan& p, const Tensor& o, const Device& d) {
      ops::moe_combine_backward(on(dy, d), on(eo, d), on(prob, d), p, o,
                                d.is_cpu() ? dprob_cpu : dprob_gpu);
    })) << "combine backward d_expert_out";
    EXPECT_TRUE(bitwise_equal(dprob_cpu, dprob_gpu)) << "combine backward dprob";
  }
  const Tensor row_prob_cpu = Tensor::empty({cap}, DType::f32);
  const Tensor row_prob_gpu = Tensor::empty({cap}, DType::f32, kGpu);
  ops::moe_gather_row_probs(prob, cpu, row_prob_cpu);
  ops::moe_gather_row_probs(on(prob, kGpu), gpu, row_prob_gpu);
  EXPECT_TRUE(bitwise_equal(row_prob_cpu, row_prob_gpu)) << "gather";
  const Tensor back_gpu = Tensor::empty({c.tokens, c.topk}, DType::f32, kGpu);
  ops::moe_scatter_row_probs(row_prob_gpu, gpu, back_gpu);
  EXPECT_TRUE(bitwise_equal(prob, back_gpu)) << "scatter undoes gather";
}

INSTANTIATE_TEST_SUITE_P(Ops, MoeLayoutTest, ::testing::ValuesIn(kSplits),
                         [](const auto& info) { return std::string(info.param.name); });

// ----------------------------------------------------------------------------
// Scaled activation

struct ActivationInputs {
  Tensor expert, fc1, row_prob, bias, dh;
  MoePlan plan;
};

/// fc1 in [-3, 3], probs in [0.05, 1], bias and dh in [-1, 1] for `split` on the CPU.
ActivationInputs draw_activation_inputs(MoeActivation act, Split split, int64_t tokens,
                                        int64_t topk, int64_t experts, int64_t f, DType dtype,
                                        std::mt19937_64& rng) {
  ActivationInputs in;
  in.expert = draw_experts(tokens, topk, experts, split, rng);
  in.plan = make_plan(in.expert, experts, kCpu);
  const int64_t cap = in.plan.capacity();
  in.fc1 = uniform({cap, ops::moe_activation_input_cols(act, f)}, -3.0f, 3.0f, rng, dtype);
  const Tensor prob = uniform({tokens, topk}, 0.05f, 1.0f, rng);
  in.row_prob = Tensor::empty({cap}, DType::f32);
  ops::moe_gather_row_probs(prob, in.plan, in.row_prob);
  in.bias = uniform({experts, f}, -1.0f, 1.0f, rng);
  in.dh = uniform({cap, f}, -1.0f, 1.0f, rng, dtype);
  return in;
}

struct ActivationGrads {
  Tensor h, dfc1, d_row_prob, dbias;
};

ActivationGrads run_activation(MoeActivation act, const ActivationInputs& in, const Device& d,
                               bool with_bias = true) {
  const MoePlan plan = d.is_cpu() ? in.plan : make_plan(in.expert, in.plan.experts(), d);
  const Tensor bias = with_bias ? on(in.bias, d) : Tensor();
  ActivationGrads g;
  g.h = Tensor::empty(in.dh.shape(), in.dh.dtype(), d);
  g.dfc1 = Tensor::empty(in.fc1.shape(), in.fc1.dtype(), d);
  g.d_row_prob = Tensor::empty({plan.capacity()}, DType::f32, d);
  if (with_bias) g.dbias = Tensor::empty(in.bias.shape(), DType::f32, d);
  ops::moe_scaled_activation_forward(act, on(in.fc1, d), on(in.row_prob, d), plan, bias, g.h);
  ops::moe_scaled_activation_backward(act, on(in.dh, d), on(in.fc1, d), on(in.row_prob, d), plan,
                                      bias, g.dfc1, g.d_row_prob, g.dbias);
  return g;
}

const MoeActivation kActivations[] = {MoeActivation::swiglu, MoeActivation::geglu,
                                      MoeActivation::srelu, MoeActivation::gelu};

class ScaledActivationTest : public ::testing::TestWithParam<MoeActivation> {};

/// dfc1, d_row_prob and dbias against central differences of L = sum dh * h, in each input.
TEST_P(ScaledActivationTest, BackwardMatchesCentralDifferences) {
  const MoeActivation act = GetParam();
  std::mt19937_64 rng(fresh_seed());
  const int64_t tokens = 10, topk = 2, experts = 4, f = 6;
  ActivationInputs in =
      draw_activation_inputs(act, Split::random, tokens, topk, experts, f, DType::f32, rng);
  const ActivationGrads g = run_activation(act, in, kCpu);
  const std::vector<float> w = to_floats(in.dh);
  const auto forward = [&] {
    const Tensor h = Tensor::empty(in.dh.shape(), DType::f32);
    ops::moe_scaled_activation_forward(act, in.fc1, in.row_prob, in.plan, in.bias, h);
    return to_floats(h);
  };
  constexpr float kStep = 1e-3f;
  EXPECT_TRUE(testing::matches_central_differences(in.fc1, forward, w, to_floats(g.dfc1), kStep,
                                                   2e-3, 2e-3))
      << "dfc1";
  EXPECT_TRUE(testing::matches_central_differences(in.row_prob, forward, w,
                                                   to_floats(g.d_row_prob), kStep, 2e-3, 2e-3))
      << "d_row_prob";
  EXPECT_TRUE(testing::matches_central_differences(in.bias, forward, w, to_floats(g.dbias), kStep,
                                                   2e-3, 2e-3))
      << "dbias";
}

/// CUDA = CPU for every split and dtype: dbias bitwise (it sums the inputs in the same order);
/// srelu's h, dfc1 and d_row_prob bitwise too (no transcendental); the others within 2e-5 of
/// max|CPU| in f32 and one bf16 ulp (2^-8) of it in bf16 (expf/tanhf an ulp apart).
TEST_P(ScaledActivationTest, CudaMatchesCpu) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  const MoeActivation act = GetParam();
  std::mt19937_64 rng(fresh_seed());
  for (const SplitCase& c : kSplits)
    for (DType dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(::testing::Message() << c.name << " " << dtype_name(dtype));
      const ActivationInputs in =
          draw_activation_inputs(act, c.split, c.tokens, c.topk, c.experts, 2 * c.dim + 2,
                                 dtype, rng);
      const ActivationGrads cpu = run_activation(act, in, kCpu), gpu = run_activation(act, in, kGpu);
      EXPECT_TRUE(bitwise_equal(cpu.dbias, gpu.dbias)) << "dbias";
      if (act == MoeActivation::srelu) {
        EXPECT_TRUE(bitwise_equal(cpu.h, gpu.h)) << "h";
        EXPECT_TRUE(bitwise_equal(cpu.dfc1, gpu.dfc1)) << "dfc1";
        EXPECT_TRUE(bitwise_equal(cpu.d_row_prob, gpu.d_row_prob)) << "d_row_prob";
      } else {
        const double tol = dtype == DType::bf16 ? 1.0 / 256 : 2e-5;
        EXPECT_TRUE(close_rel(gpu.h, cpu.h, tol)) << "h";
        EXPECT_TRUE(close_rel(gpu.dfc1, cpu.dfc1, tol)) << "dfc1";
        EXPECT_TRUE(close_rel(gpu.d_row_prob, cpu.d_row_prob, 2e-5)) << "d_row_prob";
      }
    }
}

/// FC2's FP8 input, one target per expert with rows, each with its own scale (a shared scale
/// would be caught) saturating the top of most experts' rows, and an amax starting below them.
struct ExpertCastTargets {
  std::vector<int64_t> offsets;
  std::vector<fp8::QuantizedTensor> q;
  std::vector<Tensor> amax;
  std::vector<ops::FusedQuantize> fused;

  ExpertCastTargets(std::vector<int64_t> group_offsets, int64_t f, const testing::FusedCase& c,
                    const Device& d)
      : offsets(std::move(group_offsets)) {
    const size_t experts = offsets.size() - 1;
    q.resize(experts);
    amax.resize(experts);
    fused.resize(experts);
    for (size_t e = 0; e < experts; ++e) {
      const int64_t rows = offsets[e + 1] - offsets[e];
      if (rows <= 0) continue;
      q[e] = fp8::QuantizedTensor::allocate(rows, f, c.fp8, c.mode, c.usage, d);
      amax[e] = on(Tensor::from_vector({1e-3f}, {1}), d);
      const float scale = fp8::fp8_max(c.fp8) / (1.0f + 0.5f * static_cast<float>(e));
      fused[e] = {&q[e], ops::QuantizeArgs{on(Tensor::from_vector({scale}, {1}), d), amax[e]}};
    }
  }
  ops::MoeExpertCasts casts() const { return {offsets, fused}; }
};

/// Every expert's FP8 copies, scales and amax bitwise equal between a and b.
void expect_same_casts(const ExpertCastTargets& a, const ExpertCastTargets& b,
                       const testing::FusedCase& c) {
  for (size_t e = 0; e < a.q.size(); ++e) {
    if (a.fused[e].out == nullptr) continue;
    SCOPED_TRACE(::testing::Message() << "expert " << e);
    if (c.usage.rowwise) {
      EXPECT_TRUE(bitwise_equal(a.q[e].data, b.q[e].data)) << "data";
      EXPECT_TRUE(bitwise_equal(a.q[e].scale_inv, b.q[e].scale_inv)) << "scale_inv";
    }
    if (c.usage.columnwise) {
      EXPECT_TRUE(bitwise_equal(a.q[e].data_t, b.q[e].data_t)) << "data_t";
      EXPECT_TRUE(bitwise_equal(a.q[e].scale_inv_t, b.q[e].scale_inv_t)) << "scale_inv_t";
    }
    EXPECT_TRUE(bitwise_equal(a.amax[e], b.amax[e])) << "amax";
  }
}

std::vector<int64_t> host_offsets(const MoePlan& plan) {
  const std::vector<int32_t> o = ints(plan.offsets);
  return std::vector<int64_t>(o.begin(), o.end());
}

/// The fused per-expert cast against the unfused path (the activation, then ops::quantize of each
/// expert's rows with its own target), bitwise, with and without h, on every backend and fused
/// path, including empty experts and very uneven splits; srelu (no transcendental) also CUDA =
/// CPU bitwise.
TEST_P(ScaledActivationTest, PerExpertFusedCastMatchesUnfused) {
  const MoeActivation act = GetParam();
  std::mt19937_64 rng(fresh_seed());
  for (const SplitCase& split : kSplits) {
    const DType dtype = split.split == Split::random ? DType::f32 : DType::bf16;
    const ActivationInputs in = draw_activation_inputs(act, split.split, split.tokens, split.topk,
                                                       split.experts, split.dim, dtype, rng);
    const std::vector<int64_t> offsets = host_offsets(in.plan);
    for (const testing::FusedCase& c : testing::fused_cases()) {
      std::vector<ExpertCastTargets> cpu_fused;
      for (const Device& d : testing::all_backends()) {
        if (d.is_cuda() && cuda_device_count() == 0) continue;
        SCOPED_TRACE(::testing::Message() << split.name << " " << d.str() << " "
                                          << fp8::scaling_mode_name(c.mode) << " "
                                          << dtype_name(c.fp8));
        const MoePlan plan = d.is_cpu() ? in.plan : make_plan(in.expert, split.experts, d);
        const Tensor fc1 = on(in.fc1, d), row_prob = on(in.row_prob, d), bias = on(in.bias, d);
        const Tensor h = Tensor::empty(in.dh.shape(), dtype, d);
        ops::moe_scaled_activation_forward(act, fc1, row_prob, plan, bias, h);
        ExpertCastTargets unfused(offsets, split.dim, c, d);
        for (size_t e = 0; e + 1 < offsets.size(); ++e)
          if (offsets[e + 1] > offsets[e])
            ops::quantize(h.slice(offsets[e], offsets[e + 1]), unfused.q[e], unfused.fused[e].args);

        ExpertCastTargets with_h(offsets, split.dim, c, d), fp8_only(offsets, split.dim, c, d);
        const Tensor fused_h = Tensor::empty(in.dh.shape(), dtype, d);
        const ops::MoeExpertCasts casts = with_h.casts(), casts_only = fp8_only.casts();
        ops::moe_scaled_activation_forward(act, fc1, row_prob, plan, bias, fused_h, &casts);
        ops::moe_scaled_activation_forward(act, fc1, row_prob, plan, bias, Tensor(), &casts_only);
        EXPECT_TRUE(bitwise_equal(h, fused_h)) << "h";
        expect_same_casts(unfused, with_h, c);
        expect_same_casts(unfused, fp8_only, c);
        if (d.is_cpu()) cpu_fused.push_back(std::move(fp8_only));
        if (d.is_cuda() && act == MoeActivation::srelu) expect_same_casts(cpu_fused.at(0), fp8_only, c);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, ScaledActivationTest, ::testing::ValuesIn(kActivations),
                         [](const auto& info) { return ops::moe_activation_name(info.param); });

/// The per-expert casts must match the plan: one target per expert with rows, the host offsets
/// those of the plan, no column sums.
TEST(MoeExpertCasts, RefusesTargetsThatDoNotMatchThePlan) {
  std::mt19937_64 rng(fresh_seed());
  const int64_t f = 32;
  const ActivationInputs in =
      draw_activation_inputs(MoeActivation::srelu, Split::random, 40, 2, 4, f, DType::f32, rng);
  const testing::FusedCase c = testing::fused_cases().front();
  std::vector<int64_t> offsets = host_offsets(in.plan);
  const auto run = [&](const ExpertCastTargets& t) {
    const ops::MoeExpertCasts casts = t.casts();
    ops::moe_scaled_activation_forward(MoeActivation::srelu, in.fc1, in.row_prob, in.plan,
                                       in.bias, Tensor(), &casts);
  };
  size_t busy = 0;  // an expert with rows
  while (offsets[busy + 1] == offsets[busy]) ++busy;
  ExpertCastTargets missing(offsets, f, c, kCpu);
  missing.fused[busy] = {};
  testing::expect_error([&] { run(missing); },
                        {"expert " + std::to_string(busy) + " has", "no QuantizedTensor"});
  ExpertCastTargets sums(offsets, f, c, kCpu);
  sums.fused[busy].args.column_sums = Tensor::zeros({f}, DType::f32);
  testing::expect_error([&] { run(sums); }, {"column sums are not supported"});
  std::vector<int64_t> shifted = offsets;
  shifted[1] += ops::kMoeGroupAlign;
  testing::expect_error([&] { run(ExpertCastTargets(shifted, f, c, kCpu)); },
                        {"casts.offsets[1]", "plan's"});
}

// ----------------------------------------------------------------------------
// Repeatability at the field shape (FIELD-NOTES section 3): 16 experts x 1024 routed rows each,
// top-2, hidden = ffn = 2048, bf16. Compared as bytes (+0.0 == -0.0 and NaN fool values).

constexpr int64_t kFieldExperts = 16, kFieldRowsPerExpert = 1024, kFieldTopk = 2,
                  kFieldHidden = 2048;
/// Runs of each op (OCTET_TEST_REPEATS overrides).
int repeats() { return testing::repeats(8); }

/// Every element finite.
::testing::AssertionResult all_finite(const Tensor& t, const char* what) {
  for (float v : to_floats(t))
    if (!std::isfinite(v)) return ::testing::AssertionFailure() << what << " has " << v;
  return ::testing::AssertionSuccess();
}

class FieldShapeRepeatability : public ::testing::TestWithParam<MoeActivation> {};

TEST_P(FieldShapeRepeatability, BackwardIsBytewiseRepeatable) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  const MoeActivation act = GetParam();
  std::mt19937_64 rng(fresh_seed());
  const int64_t tokens = kFieldExperts * kFieldRowsPerExpert / kFieldTopk;
  // Exactly 1024 rows per expert: token t's slots go to experts 2t mod 16 and 2t + 1 mod 16.
  Tensor expert = Tensor::empty({tokens, kFieldTopk}, DType::i32);
  for (int64_t i = 0; i < tokens * kFieldTopk; ++i)
    expert.data<int32_t>()[i] = static_cast<int32_t>(i % kFieldExperts);
  const MoePlan plan = make_plan(expert, kFieldExperts, kGpu);
  const int64_t cap = plan.capacity(), f = kFieldHidden;
  const Tensor prob = on(uniform({tokens, kFieldTopk}, 0.05f, 1.0f, rng), kGpu);
  const Tensor row_prob = Tensor::empty({cap}, DType::f32, kGpu);
  ops::moe_gather_row_probs(prob, plan, row_prob);
  const Tensor fc1 =
      on(uniform({cap, ops::moe_activation_input_cols(act, f)}, -3.0f, 3.0f, rng, DType::bf16), kGpu);
  const Tensor dh = on(uniform({cap, f}, -1.0f, 1.0f, rng, DType::bf16), kGpu);
  const Tensor bias = on(uniform({kFieldExperts, f}, -1.0f, 1.0f, rng), kGpu);
  const Tensor dy = on(uniform({tokens, kFieldHidden}, -1.0f, 1.0f, rng, DType::bf16), kGpu);
  const Tensor expert_out = on(uniform({cap, kFieldHidden}, -1.0f, 1.0f, rng, DType::bf16), kGpu);

  std::vector<std::vector<uint8_t>> first;
  for (int run = 0; run < repeats(); ++run) {
    SCOPED_TRACE(::testing::Message() << "repeat " << run);
    const Tensor dfc1 = Tensor::empty(fc1.shape(), DType::bf16, kGpu);
    const Tensor d_row_prob = Tensor::empty({cap}, DType::f32, kGpu);
    const Tensor dbias = Tensor::empty(bias.shape(), DType::f32, kGpu);
    ops::moe_scaled_activation_backward(act, dh, fc1, row_prob, plan, bias, dfc1, d_row_prob,
                                        dbias);
    const Tensor d_expert_out = Tensor::empty(expert_out.shape(), DType::bf16, kGpu);
    const Tensor dprob = Tensor::empty(prob.shape(), DType::f32, kGpu);
    ops::moe_combine_backward(dy, expert_out, prob, plan, d_expert_out, dprob);
    const Tensor outputs[] = {dfc1, d_row_prob, dbias, d_expert_out, dprob};
    const char* names[] = {"dfc1", "dprob (activation)", "dbias", "d_expert_out",
                           "dprob (combine)"};
    for (int i = 0; i < 5; ++i) {
      ASSERT_TRUE(all_finite(outputs[i], names[i]));
      if (run == 0) {
        first.push_back(testing::to_bytes(outputs[i]));
      } else {
        EXPECT_TRUE(first[i] == testing::to_bytes(outputs[i])) << names[i] << " differs bytewise";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, FieldShapeRepeatability,
                         ::testing::Values(MoeActivation::swiglu, MoeActivation::srelu),
                         [](const auto& info) { return ops::moe_activation_name(info.param); });

}  // namespace
}  // namespace octet
