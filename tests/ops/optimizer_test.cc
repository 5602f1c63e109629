// Tests of the optimizer family on every backend: global_norm_squared against an independent
// emulation of its documented order (bit for bit) and a long-double sum; adamw_step against a
// float64 AdamW with clipping; CPU and CUDA bit for bit over several steps; byte-for-byte
// repeatability of the norm on CUDA; and the messages for bad input.
#include "octet/ops/optimizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <iterator>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ops/op_check.h"
#include "ops/optimizer_backend.h"
#include "test_util.h"

namespace octet {
namespace {

using testing::bitwise_equal;
using testing::device_name;
using testing::expect_error;
using testing::fresh_seed;
using testing::on;
using testing::to_bytes;
using testing::to_floats;

std::string shape_name(const Shape& shape) {
  std::string name;
  for (int64_t extent : shape) name += (name.empty() ? "" : "x") + std::to_string(extent);
  return name;
}

// ----------------------------------------------------------------------------
// global_norm_squared

/// optimizer_backend.h's order written out independently: lane t of kNormLanes sums values t,
/// t + kNormLanes, ... from +0; then lane[t] += lane[t + s] for s = kNormLanes/2 .. 1.
double lanes_then_tree(const std::vector<double>& values) {
  std::vector<double> lane(ops::kNormLanes, 0.0);
  for (size_t i = 0; i < values.size(); ++i) lane[i % ops::kNormLanes] += values[i];
  for (int s = ops::kNormLanes / 2; s > 0; s /= 2)
    for (int t = 0; t < s; ++t) lane[t] += lane[t + s];
  return lane[0];
}

/// The documented order: chunk partials, per-tensor sums of the partials, tensors in order.
float documented_norm_sq(const std::vector<std::vector<float>>& tensors) {
  double total = 0.0;
  for (const std::vector<float>& g : tensors) {
    std::vector<double> partials;
    for (size_t begin = 0; begin < g.size(); begin += ops::kNormChunk) {
      std::vector<double> squares;
      for (size_t i = begin; i < std::min(g.size(), begin + ops::kNormChunk); ++i)
        squares.push_back(static_cast<double>(g[i]) * g[i]);
      partials.push_back(lanes_then_tree(squares));
    }
    total += lanes_then_tree(partials);
  }
  return static_cast<float>(total);
}

struct NormCase {
  Device backend;
  std::string name;
  std::vector<Shape> shapes;
};

std::vector<NormCase> norm_cases() {
  std::vector<Shape> many;  // more tensors than one CUDA launch describes (32)
  for (int i = 0; i < 40; ++i) many.push_back({(i * 37) % 500 + 1});
  std::vector<NormCase> cases;
  for (const Device& d : testing::all_backends()) {
    cases.push_back({d, "one_3221", {{3221}}});
    cases.push_back({d, "awkward", {{2333, 1}, {1481, 677}, {7}}});
    cases.push_back({d, "forty_tensors", many});
    // 513 chunks: the second stage folds more than one partial per lane.
    cases.push_back({d, "two_million", {{2100000}, {1}}});
  }
  return cases;
}

using GlobalNormSquared = testing::SeededParityTest<NormCase>;

TEST_P(GlobalNormSquared, FollowsTheDocumentedOrderBitwiseAndIsWithinAnUlpOfExact) {
  const NormCase& p = GetParam();
  std::vector<Tensor> grads;
  std::vector<std::vector<float>> values;
  for (size_t i = 0; i < p.shapes.size(); ++i) {
    // Magnitudes from 1e-3 to 1e3 across tensors, so the tensor sums differ widely.
    const float scale = std::pow(10.0f, static_cast<float>(i % 7) - 3.0f);
    Tensor g = testing::random_tensor(p.shapes[i], DType::f32, seed + i, scale);
    values.push_back(to_floats(g));
    grads.push_back(g.to(p.backend));
  }
  Tensor norm_sq = Tensor::empty({1}, DType::f32, p.backend);

  ops::global_norm_squared(grads.data(), static_cast<int>(grads.size()), norm_sq);

  const float got = to_floats(norm_sq)[0];
  EXPECT_EQ(fp8::float_bits(got), fp8::float_bits(documented_norm_sq(values)))
      << "got " << got << ", documented order gives " << documented_norm_sq(values);
  long double exact = 0;
  for (const auto& g : values)
    for (float x : g) exact += static_cast<long double>(x) * x;
  // Double accumulation leaves only the final rounding to f32: half an ulp plus a hair, and
  // 0.51 * 2^-23 * exact is at least that wherever exact lies in its binade.
  EXPECT_NEAR(got, static_cast<double>(exact), 0.51 * FLT_EPSILON * static_cast<double>(exact));
}

INSTANTIATE_TEST_SUITE_P(Ops, GlobalNormSquared, ::testing::ValuesIn(norm_cases()),
                         [](const ::testing::TestParamInfo<NormCase>& info) {
                           return device_name(info.param.backend) + "_" + info.param.name;
                         });

// ----------------------------------------------------------------------------
// adamw_step

struct AdamWCase {
  Device backend;
  Shape shape;
  float norm_sq;
  float max_grad_norm;
  float weight_decay;
  int64_t step;
};

std::vector<AdamWCase> adamw_cases() {
  std::vector<AdamWCase> cases;
  for (const Device& d : testing::all_backends()) {
    cases.push_back({d, {3221}, 0.25f, 1.0f, 0.1f, 1});         // norm 0.5 < 1: no clipping
    cases.push_back({d, {2333, 1}, 400.0f, 1.0f, 0.1f, 7});     // norm 20: scaled by ~0.05
    cases.push_back({d, {1481, 677}, 1e6f, 0.0f, 0.0f, 1000});  // clipping off, no decay
    cases.push_back({d, {17, 5}, 9.0f, 0.5f, 0.01f, 3});
  }
  return cases;
}

std::string adamw_name(const ::testing::TestParamInfo<AdamWCase>& info) {
  const AdamWCase& p = info.param;
  return device_name(p.backend) + "_" + shape_name(p.shape) + "_step" + std::to_string(p.step) +
         (p.max_grad_norm > 0 ? "_clip" : "_noclip") + (p.weight_decay > 0 ? "_wd" : "");
}

using AdamWStep = testing::SeededParityTest<AdamWCase>;

TEST_P(AdamWStep, MatchesFloat64AdamWWithClipping) {
  const AdamWCase& p = GetParam();
  ops::AdamWArgs args;
  args.lr = 1e-3f;
  args.weight_decay = p.weight_decay;
  args.step = p.step;
  args.max_grad_norm = p.max_grad_norm;
  const Tensor param0 = testing::random_tensor(p.shape, DType::f32, seed);
  const Tensor grad = testing::random_tensor(p.shape, DType::f32, seed + 1);
  const Tensor m0 = testing::random_tensor(p.shape, DType::f32, seed + 2, 0.1f);
  Tensor v0 = testing::random_tensor(p.shape, DType::f32, seed + 3, 0.01f);
  for (int64_t i = 0; i < v0.numel(); ++i) v0.data<float>()[i] = std::fabs(v0.data<float>()[i]);
  Tensor param = param0.to(p.backend), m = m0.to(p.backend), v = v0.to(p.backend);

  ops::adamw_step(param, grad.to(p.backend), m, v,
                  Tensor::from_vector({p.norm_sq}, {1}).to(p.backend), args);

  const double b1 = args.beta1, b2 = args.beta2;
  const double clip = p.max_grad_norm > 0
                          ? std::min(1.0, p.max_grad_norm / (std::sqrt(double{p.norm_sq}) + 1e-6))
                          : 1.0;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(p.step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(p.step));
  const std::vector<float> got_p = to_floats(param), got_m = to_floats(m), got_v = to_floats(v);
  constexpr double kEps = FLT_EPSILON;
  for (int64_t i = 0; i < param0.numel(); ++i) {
    const double p0 = param0.data<float>()[i], g = grad.data<float>()[i] * clip;
    const double m_prev = m0.data<float>()[i], v_prev = v0.data<float>()[i];
    const double m_ref = b1 * m_prev + (1 - b1) * g;
    const double v_ref = b2 * v_prev + (1 - b2) * g * g;
    const double u = (m_ref / bc1) / (std::sqrt(v_ref / bc2) + args.eps);
    const double p_ref = p0 - args.lr * (u + args.weight_decay * p0);
    // |u| computed from magnitudes: m may cancel, and its absolute error follows its terms.
    const double u_magnitude = (std::fabs(b1 * m_prev) + std::fabs((1 - b1) * g)) / bc1 /
                               (std::sqrt(v_ref / bc2) + args.eps);
    ASSERT_NEAR(got_m[i], m_ref, 8 * kEps * (std::fabs(b1 * m_prev) + std::fabs((1 - b1) * g)))
        << "m[" << i << "]";
    ASSERT_NEAR(got_v[i], v_ref, 8 * kEps * (b2 * v_prev + (1 - b2) * g * g)) << "v[" << i << "]";
    ASSERT_NEAR(got_p[i], p_ref,
                2 * kEps * std::fabs(p_ref) +
                    16 * kEps * args.lr * (u_magnitude + args.weight_decay * std::fabs(p0)))
        << "param[" << i << "]";
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, AdamWStep, ::testing::ValuesIn(adamw_cases()), adamw_name);

TEST(AdamWMath, ClipFactorIsAsDocumented) {
  EXPECT_EQ(ops::adamw_clip_factor(1e6f, 0.0f), 1.0f);   // off
  EXPECT_EQ(ops::adamw_clip_factor(1e6f, -1.0f), 1.0f);  // off
  EXPECT_EQ(ops::adamw_clip_factor(0.25f, 1.0f), 1.0f);  // below the threshold
  EXPECT_EQ(ops::adamw_clip_factor(0.0f, 1.0f), 1.0f);   // zero gradient
  EXPECT_EQ(ops::adamw_clip_factor(400.0f, 1.0f), 1.0f / (20.0f + 1e-6f));
  EXPECT_EQ(ops::adamw_clip_factor(INFINITY, 1.0f), 0.0f);
  EXPECT_EQ(ops::adamw_clip_factor(NAN, 1.0f), 1.0f);
}

// ----------------------------------------------------------------------------
// adamw_step over many tensors

struct MultiCase {
  Device backend;
  std::string name;
  std::vector<Shape> shapes;
  int64_t step;
};

std::vector<MultiCase> multi_cases() {
  // Sizes around the float4 width and the kAdamWChunk boundary, GPT-2's bias and gain sizes, and
  // awkward ones; most are not a multiple of 4.
  const std::vector<Shape> mix = {{1},     {2},     {3},     {4},     {5},       {7},   {17, 5},
                                  {768},   {1600},  {1601},  {3221},  {2333, 1}, {31},  {1000},
                                  {16383}, {16384}, {16385}, {12289}, {65537},   {2304}};
  std::vector<Shape> many;  // more tensors than one CUDA launch describes (400)
  for (int i = 0; i < 700; ++i) many.push_back({i % 7 + 1});
  std::vector<MultiCase> cases;
  for (const Device& d : testing::all_backends()) {
    cases.push_back({d, "one_1", {{1}}, 1});
    cases.push_back({d, "one_3", {{3}}, 7});
    cases.push_back({d, "one_1481x677", {{1481, 677}}, 1000});
    cases.push_back({d, "one_65537", {{65537}}, 3});
    cases.push_back({d, "mix_of_20", mix, 5});
    cases.push_back({d, "seven_hundred", many, 2});
  }
  return cases;
}

/// A tensor holding `values` on `device`. With `misalign`, it starts one float into its storage,
/// so its address is 4 bytes off a 16-byte boundary (the CUDA kernel's scalar path).
Tensor placed(const Tensor& values, const Device& device, bool misalign) {
  if (!misalign) return values.to(device);
  const int64_t n = values.numel();
  Tensor t = Tensor::empty({n + 1}, DType::f32, device).slice(1, n + 1).view(values.shape());
  t.copy_from(values);
  return t;
}

using AdamWMultiTensor = testing::SeededParityTest<MultiCase>;

TEST_P(AdamWMultiTensor, EqualsOneStepPerTensorAndTheCpuBitwise) {
  const MultiCase& p = GetParam();
  // Decays as the trainer mixes them: 0 for biases and gains, one value for the matrices, and
  // others, so an entry that took another entry's decay would show.
  constexpr float kDecays[] = {0.0f, 0.1f, 0.01f, 0.3f};
  ops::AdamWArgs args;
  args.lr = 1e-3f;
  args.step = p.step;
  args.max_grad_norm = 1.0f;
  // Norm from ~0.3 to ~30: clipping is active in most runs, and the clip factor differs each run.
  const float norm_sq = std::uniform_real_distribution<float>(0.1f, 900.0f)(rng);
  const Tensor cpu_norm = Tensor::from_vector({norm_sq}, {1});
  const Tensor norm = cpu_norm.to(p.backend);

  std::vector<ops::AdamWTensor> reference, per_tensor, multi;
  std::vector<Tensor> before;
  for (size_t i = 0; i < p.shapes.size(); ++i) {
    const Shape& shape = p.shapes[i];
    const uint64_t s = seed + 4 * i;
    const Tensor param = testing::random_tensor(shape, DType::f32, s);
    const Tensor grad = testing::random_tensor(shape, DType::f32, s + 1);
    const Tensor m = testing::random_tensor(shape, DType::f32, s + 2, 0.1f);
    Tensor v = testing::random_tensor(shape, DType::f32, s + 3, 0.01f);
    for (int64_t j = 0; j < v.numel(); ++j) v.data<float>()[j] = std::fabs(v.data<float>()[j]);
    const float decay = kDecays[rng() % std::size(kDecays)];
    before.push_back(param);
    reference.push_back({param.clone(), grad, m.clone(), v.clone(), decay});
    per_tensor.push_back(
        {param.to(p.backend), grad.to(p.backend), m.to(p.backend), v.to(p.backend), decay});
    // Some entries misaligned in one of their tensors, so both kernel paths run in one launch.
    multi.push_back({placed(param, p.backend, i % 5 == 2), placed(grad, p.backend, i % 5 == 3),
                     placed(m, p.backend, i % 5 == 4), placed(v, p.backend, false), decay});
  }

  for (ops::AdamWTensor& t : reference) {
    args.weight_decay = t.weight_decay;
    ops::adamw_step(t.param, t.grad, t.m, t.v, cpu_norm, args);
  }
  for (ops::AdamWTensor& t : per_tensor) {
    args.weight_decay = t.weight_decay;
    ops::adamw_step(t.param, t.grad, t.m, t.v, norm, args);
  }
  args.weight_decay = 0.5f;  // documented as unread: the entries' own decays apply
  ops::adamw_step(multi.data(), static_cast<int>(multi.size()), norm, args);

  for (size_t i = 0; i < multi.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i) + " " + shape_str(p.shapes[i]) + " decay " +
                 std::to_string(multi[i].weight_decay));
    ASSERT_FALSE(bitwise_equal(before[i], reference[i].param)) << "the step left param as it was";
    EXPECT_TRUE(bitwise_equal(reference[i].param, multi[i].param)) << "param, multi vs CPU";
    EXPECT_TRUE(bitwise_equal(reference[i].m, multi[i].m)) << "m, multi vs CPU";
    EXPECT_TRUE(bitwise_equal(reference[i].v, multi[i].v)) << "v, multi vs CPU";
    EXPECT_TRUE(bitwise_equal(reference[i].param, per_tensor[i].param)) << "param, one tensor";
    EXPECT_TRUE(bitwise_equal(reference[i].m, per_tensor[i].m)) << "m, one tensor";
    EXPECT_TRUE(bitwise_equal(reference[i].v, per_tensor[i].v)) << "v, one tensor";
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, AdamWMultiTensor, ::testing::ValuesIn(multi_cases()),
                         [](const ::testing::TestParamInfo<MultiCase>& info) {
                           return device_name(info.param.backend) + "_" + info.param.name;
                         });

// ----------------------------------------------------------------------------
// adamw_step with FP8 casts of the updated parameters (AdamWTensor::cast)

struct CastEntry {
  Shape shape;
  DType fp8;
  fp8::Usage usage;
  bool amax;
  bool cast = true;
};

/// The step with casts on `backend`, and the same step without them followed by ops::quantize of
/// each updated parameter: every tensor, FP8 copy, scale and amax bitwise equal. On CUDA the cast
/// results must also equal the CPU's (both are bitwise the reference semantics).
TEST(AdamWCast, EqualsTheStepThenQuantizeBitwise) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // Awkward and aligned shapes (the last: whole 16-byte rows, rows short of a 16-row run), both
  // FP8 dtypes, every combination of copies, and an entry without a cast (a bias) in the same
  // step. Every entry but the third also gets a bf16 copy (AdamWTensor::bf16_copy), which must
  // equal ops::cast after the step.
  const std::vector<CastEntry> entries = {
      {{1481, 677}, DType::e4m3, {true, true}, true}, {{128, 256}, DType::e5m2, {true, true}, true},
      {{96, 80}, DType::e4m3, {true, false}, false},  {{200}, DType::e4m3, {}, false, false},
      {{64, 48}, DType::e4m3, {false, true}, true},   {{1600, 64}, DType::e5m2, {true, true}, true},
      {{100, 256}, DType::e4m3, {true, true}, true}};
  ops::AdamWArgs args;
  args.lr = 1e-2f;
  args.step = 3;
  const float norm_value = 4.0f;
  /// Scale: values of about 0.05 reach the FP8 maximum, so the largest saturate.
  constexpr float kAmaxAtMax = 0.05f;
  constexpr float kAmaxBefore = 1e-4f;

  struct Run {
    std::vector<Tensor> param, m, v;
    std::vector<fp8::QuantizedTensor> q;
    std::vector<Tensor> amax, bf16;
  };
  const auto has_copy = [](size_t i) { return i != 2; };
  const auto run = [&](const Device& device, bool fused) {
    Run r;
    std::vector<ops::AdamWTensor> table;
    std::vector<ops::FusedQuantize> casts(entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      const CastEntry& e = entries[i];
      const uint64_t s = seed + 4 * i;
      r.param.push_back(testing::random_tensor(e.shape, DType::f32, s, 0.1f).to(device));
      const Tensor grad = testing::random_tensor(e.shape, DType::f32, s + 1).to(device);
      r.m.push_back(testing::random_tensor(e.shape, DType::f32, s + 2, 0.1f).to(device));
      Tensor v = testing::random_tensor(e.shape, DType::f32, s + 3, 0.01f);
      for (int64_t j = 0; j < v.numel(); ++j) v.data<float>()[j] = std::fabs(v.data<float>()[j]);
      r.v.push_back(v.to(device));
      table.push_back({r.param[i], grad, r.m[i], r.v[i], 0.1f});
      r.q.push_back(e.cast ? fp8::QuantizedTensor::allocate(e.shape[0], e.shape[1], e.fp8,
                                                            fp8::ScalingMode::per_tensor, e.usage,
                                                            device)
                           : fp8::QuantizedTensor());
      r.amax.push_back(on(Tensor::from_vector({kAmaxBefore}, {1}), device));
      r.bf16.push_back(has_copy(i) ? Tensor::empty(e.shape, DType::bf16, device) : Tensor());
      if (fused) table.back().bf16_copy = r.bf16[i];
    }
    for (size_t i = 0; i < entries.size(); ++i) {
      if (!entries[i].cast) continue;
      casts[i].out = &r.q[i];
      casts[i].args.scale =
          on(Tensor::from_vector({fp8::fp8_max(entries[i].fp8) / kAmaxAtMax}, {1}), device);
      if (entries[i].amax) casts[i].args.amax = r.amax[i];
      if (fused) table[i].cast = &casts[i];
    }
    const Tensor norm = on(Tensor::from_vector({norm_value}, {1}), device);
    ops::adamw_step(table.data(), static_cast<int>(table.size()), norm, args);
    if (!fused) {
      for (size_t i = 0; i < entries.size(); ++i) {
        if (entries[i].cast) ops::quantize(r.param[i], r.q[i], casts[i].args);
        if (has_copy(i)) ops::cast(r.param[i], r.bf16[i]);
      }
    }
    return r;
  };
  const auto expect_equal = [&](const Run& a, const Run& b) {
    for (size_t i = 0; i < entries.size(); ++i) {
      SCOPED_TRACE("entry " + std::to_string(i));
      EXPECT_TRUE(bitwise_equal(a.param[i], b.param[i])) << "param";
      EXPECT_TRUE(bitwise_equal(a.m[i], b.m[i])) << "m";
      EXPECT_TRUE(bitwise_equal(a.v[i], b.v[i])) << "v";
      EXPECT_TRUE(bitwise_equal(a.amax[i], b.amax[i])) << "amax";
      if (has_copy(i)) EXPECT_TRUE(bitwise_equal(a.bf16[i], b.bf16[i])) << "bf16 copy";
      if (!entries[i].cast) continue;
      for (const auto& [x, y, what] :
           {std::tuple{&a.q[i].data, &b.q[i].data, "data"},
            std::tuple{&a.q[i].data_t, &b.q[i].data_t, "data_t"},
            std::tuple{&a.q[i].scale_inv, &b.q[i].scale_inv, "scale_inv"},
            std::tuple{&a.q[i].scale_inv_t, &b.q[i].scale_inv_t, "scale_inv_t"}}) {
        EXPECT_EQ(x->defined(), y->defined()) << what;
        if (x->defined()) EXPECT_TRUE(bitwise_equal(*x, *y)) << what;
      }
    }
  };
  const Run cpu = run(Device::cpu(), true);
  expect_equal(cpu, run(Device::cpu(), false));
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].amax) EXPECT_GT(to_floats(cpu.amax[i])[0], kAmaxBefore) << "amax not raised";
  }
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const Run cuda = run(gpu, true);
  expect_equal(cuda, run(gpu, false));
  expect_equal(cuda, cpu);
}

TEST(AdamWCast, RefusesWhatItCannotWrite) {
  const Tensor p = Tensor::zeros({4, 8}, DType::f32), b = Tensor::zeros({8}, DType::f32);
  const Tensor norm = Tensor::from_vector({1.0f}, {1});
  fp8::QuantizedTensor block = fp8::QuantizedTensor::allocate(
      4, 8, DType::e4m3, fp8::ScalingMode::block_1x128, {true, true}, Device::cpu());
  fp8::QuantizedTensor wrong = fp8::QuantizedTensor::allocate(
      8, 4, DType::e4m3, fp8::ScalingMode::per_tensor, {true, true}, Device::cpu());
  ops::FusedQuantize block_cast{&block, {}}, wrong_cast{&wrong, {}};
  wrong_cast.args.scale = Tensor::from_vector({1.0f}, {1});
  const auto step = [&](const Tensor& param, const ops::FusedQuantize* cast) {
    ops::AdamWTensor t{param, param.clone(), param.clone(), param.clone(), 0.0f, cast};
    ops::adamw_step(&t, 1, norm, ops::AdamWArgs{});
  };
  expect_error([&] { step(p, &block_cast); }, {"adamw_step", "tensors[0].cast", "per_tensor"});
  ops::AdamWTensor copied{p, p.clone(), p.clone(), p.clone(), 0.0f, nullptr,
                          Tensor::empty({8, 4}, DType::bf16)};
  expect_error([&] { ops::adamw_step(&copied, 1, norm, ops::AdamWArgs{}); },
               {"adamw_step", "tensors[0].bf16_copy must be bf16 of param's shape [4, 8]",
                "bf16[8, 4]"});
  copied.bf16_copy = Tensor::empty({4, 8}, DType::f32);
  expect_error([&] { ops::adamw_step(&copied, 1, norm, ops::AdamWArgs{}); },
               {"tensors[0].bf16_copy must be bf16"});
  expect_error([&] { step(b, &wrong_cast); }, {"adamw_step", "needs a 2-D parameter"});
  expect_error([&] { step(p, &wrong_cast); }, {"adamw_step", "shape mismatch"});
}

// ----------------------------------------------------------------------------
// CUDA: bit-exact agreement and repeatability

TEST(OptimizerCuda, AdamWAndNormEqualCpuBitwiseOverSeveralSteps) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<Shape> shapes = {{1481, 677}, {3221}, {2333, 1}};
  std::vector<Tensor> cpu_p, cpu_m, cpu_v, gpu_p, gpu_m, gpu_v;
  for (size_t i = 0; i < shapes.size(); ++i) {
    cpu_p.push_back(testing::random_tensor(shapes[i], DType::f32, seed + i));
    cpu_m.push_back(Tensor::zeros(shapes[i], DType::f32));
    cpu_v.push_back(Tensor::zeros(shapes[i], DType::f32));
    gpu_p.push_back(cpu_p.back().to(gpu));
    gpu_m.push_back(cpu_m.back().to(gpu));
    gpu_v.push_back(cpu_v.back().to(gpu));
  }
  ops::AdamWArgs args;
  args.max_grad_norm = 0.5f;  // the gradients' norm is ~600: clipping is active
  for (int64_t step = 1; step <= 3; ++step) {
    args.step = step;
    std::vector<Tensor> cpu_g, gpu_g;
    for (size_t i = 0; i < shapes.size(); ++i) {
      cpu_g.push_back(testing::random_tensor(shapes[i], DType::f32, seed + 100 * step + i));
      gpu_g.push_back(cpu_g.back().to(gpu));
    }
    Tensor cpu_norm = Tensor::empty({1}, DType::f32);
    Tensor gpu_norm = Tensor::empty({1}, DType::f32, gpu);
    ops::global_norm_squared(cpu_g.data(), static_cast<int>(cpu_g.size()), cpu_norm);
    ops::global_norm_squared(gpu_g.data(), static_cast<int>(gpu_g.size()), gpu_norm);
    ASSERT_TRUE(bitwise_equal(cpu_norm, gpu_norm)) << "norm at step " << step;
    for (size_t i = 0; i < shapes.size(); ++i) {
      ops::adamw_step(cpu_p[i], cpu_g[i], cpu_m[i], cpu_v[i], cpu_norm, args);
      ops::adamw_step(gpu_p[i], gpu_g[i], gpu_m[i], gpu_v[i], gpu_norm, args);
      EXPECT_TRUE(bitwise_equal(cpu_p[i], gpu_p[i])) << "param " << i << " at step " << step;
      EXPECT_TRUE(bitwise_equal(cpu_m[i], gpu_m[i])) << "m " << i << " at step " << step;
      EXPECT_TRUE(bitwise_equal(cpu_v[i], gpu_v[i])) << "v " << i << " at step " << step;
    }
  }
}

TEST(OptimizerCuda, GlobalNormIsRepeatableAsBytesAtModelScale) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  if (testing::small_tests_only())
    GTEST_SKIP() << "model-scale shapes left out under OCTET_TEST_SMALL";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // GPT-2 small's largest gradients (wte, one block's attention and MLP weights) plus awkward ones.
  const std::vector<Shape> shapes = {{50304, 768}, {768, 2304}, {768, 3072}, {3072, 768},
                                     {1024, 768},  {2333, 1},   {3221},      {1481, 677}};
  std::vector<Tensor> cpu_g, gpu_g;
  for (size_t i = 0; i < shapes.size(); ++i) {
    cpu_g.push_back(testing::random_tensor(shapes[i], DType::f32, seed + i, 0.01f));
    gpu_g.push_back(cpu_g.back().to(gpu));
  }
  std::vector<uint8_t> first;
  for (int run = 0; run < 3; ++run) {
    Tensor norm_sq = Tensor::empty({1}, DType::f32, gpu);
    ops::global_norm_squared(gpu_g.data(), static_cast<int>(gpu_g.size()), norm_sq);
    ASSERT_TRUE(std::isfinite(to_floats(norm_sq)[0]));
    if (run == 0) first = to_bytes(norm_sq);
    EXPECT_TRUE(to_bytes(norm_sq) == first) << "run " << run << " differs from run 0";
  }
  Tensor cpu_norm = Tensor::empty({1}, DType::f32);
  ops::global_norm_squared(cpu_g.data(), static_cast<int>(cpu_g.size()), cpu_norm);
  EXPECT_TRUE(to_bytes(cpu_norm) == first) << "CUDA differs from the CPU reference";
}

// ----------------------------------------------------------------------------
// Bad input

TEST(OptimizerBadInput, GlobalNormNamesWhatIsWrong) {
  const Tensor g = testing::random_tensor({3, 4}, DType::f32, 1);
  Tensor norm_sq = Tensor::empty({1}, DType::f32);
  using ops::global_norm_squared;
  expect_error([&] { global_norm_squared(&g, 0, norm_sq); },
               {"global_norm_squared", "expected at least one gradient tensor, got count 0"});
  expect_error([&] { global_norm_squared(nullptr, 2, norm_sq); }, {"grads is null"});
  const Tensor bf16 = testing::random_tensor({3, 4}, DType::bf16, 1);
  const Tensor mixed[] = {g, bf16};
  expect_error([&] { global_norm_squared(mixed, 2, norm_sq); },
               {"grads[1] must be f32, got bf16[3, 4]"});
  const Tensor empty = Tensor::empty({0, 4}, DType::f32);
  expect_error([&] { global_norm_squared(&empty, 1, norm_sq); }, {"grads[0] is an empty tensor"});
  const Tensor undefined;
  expect_error([&] { global_norm_squared(&undefined, 1, norm_sq); },
               {"grads[0] is an undefined tensor"});
  expect_error([&] { global_norm_squared(&g, 1, Tensor::empty({2}, DType::f32)); },
               {"norm_sq must be f32[1], got f32[2]"});
}

TEST(OptimizerBadInput, AdamWNamesWhatIsWrong) {
  const Tensor p = testing::random_tensor({3, 4}, DType::f32, 1);
  const Tensor g = testing::random_tensor({3, 4}, DType::f32, 2);
  const Tensor m = Tensor::zeros({3, 4}, DType::f32), v = Tensor::zeros({3, 4}, DType::f32);
  const Tensor norm_sq = Tensor::from_vector({1.0f}, {1});
  const ops::AdamWArgs good;
  using ops::adamw_step;
  expect_error(
      [&] {
        adamw_step(p, Tensor::zeros({4, 3}, DType::f32), m, v, norm_sq, good);
      },
      {"adamw_step", "grad must have param's shape [3, 4], got f32[4, 3]"});
  expect_error(
      [&] {
        adamw_step(p, g, Tensor::zeros({3, 4}, DType::bf16), v, norm_sq, good);
      },
      {"m must be f32, got bf16[3, 4]"});
  expect_error([&] { adamw_step(p, g, m, Tensor::zeros({12}, DType::f32), norm_sq, good); },
               {"v must have param's shape [3, 4], got f32[12]"});
  expect_error(
      [&] {
        adamw_step(Tensor::empty({0}, DType::f32), Tensor::empty({0}, DType::f32),
                   Tensor::empty({0}, DType::f32), Tensor::empty({0}, DType::f32), norm_sq, good);
      },
      {"param is an empty tensor"});
  expect_error([&] { adamw_step(p, g, m, v, Tensor::zeros({1}, DType::bf16), good); },
               {"norm_sq must be f32[1], got bf16[1]"});
  auto with = [&](auto change) {
    ops::AdamWArgs args;
    change(args);
    return args;
  };
  expect_error([&] { adamw_step(p, g, m, v, norm_sq, with([](auto& a) { a.step = 0; })); },
               {"step is 1-based and must be >= 1, got 0"});
  expect_error([&] { adamw_step(p, g, m, v, norm_sq, with([](auto& a) { a.beta1 = 1.0f; })); },
               {"beta1 must be in [0, 1), got 1"});
  expect_error([&] { adamw_step(p, g, m, v, norm_sq, with([](auto& a) { a.beta2 = -0.5f; })); },
               {"beta2 must be in [0, 1), got -0.5"});
  expect_error([&] { adamw_step(p, g, m, v, norm_sq, with([](auto& a) { a.lr = NAN; })); },
               {"lr must be finite"});
  expect_error([&] { adamw_step(p, g, m, v, norm_sq, with([](auto& a) { a.eps = 0.0f; })); },
               {"eps must be > 0, got 0"});
  expect_error(
      [&] { adamw_step(p, g, m, v, norm_sq, with([](auto& a) { a.weight_decay = -1.0f; })); },
      {"weight_decay must be >= 0, got -1"});
  expect_error(
      [&] { adamw_step(p, g, m, v, norm_sq, with([](auto& a) { a.max_grad_norm = INFINITY; })); },
      {"max_grad_norm must be finite"});
}

TEST(OptimizerBadInput, MultiTensorAdamWNamesTheEntry) {
  auto entry = [](const Shape& shape, uint64_t seed) {
    return ops::AdamWTensor{testing::random_tensor(shape, DType::f32, seed),
                            testing::random_tensor(shape, DType::f32, seed + 1),
                            Tensor::zeros(shape, DType::f32), Tensor::zeros(shape, DType::f32),
                            0.1f};
  };
  const std::vector<ops::AdamWTensor> good = {entry({3, 4}, 1), entry({5}, 3), entry({7}, 5)};
  const Tensor norm_sq = Tensor::from_vector({1.0f}, {1});
  const ops::AdamWArgs args;
  auto step = [&](std::vector<ops::AdamWTensor> tensors, const Tensor& norm = Tensor()) {
    ops::adamw_step(tensors.data(), static_cast<int>(tensors.size()),
                    norm.defined() ? norm : norm_sq, args);
  };
  /// `good` with entry i changed by `change`.
  auto with = [&](size_t i, auto change) {
    std::vector<ops::AdamWTensor> tensors = good;
    change(tensors[i]);
    return tensors;
  };
  expect_error([&] { ops::adamw_step(good.data(), 0, norm_sq, args); },
               {"adamw_step", "expected at least one tensor, got count 0"});
  expect_error([&] { ops::adamw_step(nullptr, 2, norm_sq, args); },
               {"tensors is null but count is 2"});
  expect_error([&] { step(with(1, [](auto& t) { t.grad = Tensor::zeros({4}, DType::f32); })); },
               {"adamw_step: tensors[1].grad must have param's shape [5], got f32[4]"});
  expect_error([&] { step(with(2, [](auto& t) {
                       t.v = Tensor::zeros({1, 7}, DType::f32);
                     })); },
               {"tensors[2].v must have param's shape [7], got f32[1, 7]"});
  expect_error([&] { step(with(2, [](auto& t) { t.m = Tensor::zeros({7}, DType::bf16); })); },
               {"tensors[2].m must be f32, got bf16[7]"});
  expect_error([&] { step(with(0, [](auto& t) {
                       t.param = Tensor::zeros({3, 4}, DType::i32);
                     })); },
               {"tensors[0].param must be f32, got i32[3, 4]"});
  expect_error([&] { step(with(1, [](auto& t) { t.grad = Tensor(); })); },
               {"tensors[1].grad is an undefined tensor"});
  expect_error(
      [&] {
        step(with(0, [](auto& t) {
          for (Tensor* x : {&t.param, &t.grad, &t.m, &t.v}) *x = Tensor::empty({0}, DType::f32);
        }));
      },
      {"tensors[0].param is an empty tensor"});
  expect_error([&] { step(with(2, [](auto& t) { t.weight_decay = -1.0f; })); },
               {"tensors[2].weight_decay must be >= 0, got -1"});
  expect_error([&] { step(with(1, [](auto& t) { t.weight_decay = NAN; })); },
               {"tensors[1].weight_decay must be finite"});
  expect_error([&] { step(good, Tensor::zeros({2}, DType::f32)); },
               {"norm_sq must be f32[1], got f32[2]"});
  // One launch steps all entries at once, so a tensor listed twice would race.
  expect_error(
      [&] {
        step({good[0], good[1], good[0]});
      },
      // Which of the entry's three tensors is named first depends on the allocator's addresses.
      {"tensors[2].", "overlaps tensors[0].", "in memory"});
  expect_error([&] { step(with(1, [](auto& t) { t.v = t.m; })); },
               {"tensors[1].v overlaps tensors[1].m in memory"});
  expect_error([&] { step(with(0, [](auto& t) { t.m = t.param; })); },
               {"tensors[0].m overlaps tensors[0].param"});
  const Tensor big = Tensor::zeros({8}, DType::f32);
  expect_error(
      [&] {
        step({good[0],
              {good[1].param, good[1].grad, big.slice(0, 5), good[1].v, 0.0f},
              {good[2].param, good[2].grad, good[2].m, big.slice(1, 8), 0.0f}});
      },
      {"tensors[2].v overlaps tensors[1].m in memory"});
  ops::AdamWArgs bad_step;
  bad_step.step = 0;
  expect_error([&] { ops::adamw_step(good.data(), 3, norm_sq, bad_step); },
               {"step is 1-based and must be >= 1, got 0"});
}

// A model split over GPUs has its gradients on several devices: each tensor's sum is taken where
// it lies, and the sums meet in order on norm_sq's device.
TEST(OptimizerDevices, GlobalNormOverSeveralDevicesIsTheOneDeviceNormBitwise) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const Device other = cuda_device_count() > 1 ? Device::cuda(1) : gpu;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", second GPU " + other.str());
  const std::vector<Shape> shapes = {{1481, 677}, {3221}, {2333, 1}, {64, 96}, {5000}};
  std::vector<Tensor> cpu_g;
  for (size_t i = 0; i < shapes.size(); ++i)
    cpu_g.push_back(testing::random_tensor(shapes[i], DType::f32, seed + i));
  Tensor expected = Tensor::empty({1}, DType::f32);
  ops::global_norm_squared(cpu_g.data(), static_cast<int>(cpu_g.size()), expected);
  // Runs of devices in the order a split model has them, and a device that comes back.
  const std::vector<Device> placement = {gpu, gpu, other, Device::cpu(), gpu};
  std::vector<Tensor> placed;
  for (size_t i = 0; i < shapes.size(); ++i) placed.push_back(cpu_g[i].to(placement[i]));
  for (const Device& where : {gpu, other, Device::cpu()}) {
    Tensor norm_sq = Tensor::empty({1}, DType::f32, where);
    ops::global_norm_squared(placed.data(), static_cast<int>(placed.size()), norm_sq);
    EXPECT_TRUE(bitwise_equal(norm_sq.to(Device::cpu()), expected)) << "norm_sq on " << where;
  }
}

TEST(OptimizerDevices, MixedDevicesAreRefused) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const Tensor p = testing::random_tensor({3, 4}, DType::f32, 1);
  const Tensor g = testing::random_tensor({3, 4}, DType::f32, 2).to(gpu);
  const Tensor m = Tensor::zeros({3, 4}, DType::f32), v = Tensor::zeros({3, 4}, DType::f32);
  expect_error([&] { ops::adamw_step(p, g, m, v, Tensor::from_vector({1.0f}, {1}), {}); },
               {"adamw_step: all tensors must be on one device", "cuda:0"});
  const ops::AdamWTensor tensors[] = {{p, p.clone(), m, v, 0.1f},
                                      {p.clone(), g, m.clone(), v.clone(), 0.0f}};
  expect_error([&] { ops::adamw_step(tensors, 2, Tensor::from_vector({1.0f}, {1}), {}); },
               {"adamw_step: all tensors must be on one device", "tensors[1].grad", "cuda:0"});
}

}  // namespace
}  // namespace octet
