// GEMM contract and argument tests: the CPU backend's exact order of summation and epilogue
// (src/ops/cpu/gemm.cc), pinned with values whose rounding depends on it; the GemmOperand
// factories; and bad input, refused with a message naming what was expected and what was
// received. The parity suite against the double-precision reference is in gemm_test.cc.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "octet/fp8/format.h"
#include "octet/ops/activation.h"
#include "octet/ops/gemm.h"
#include "ops/gemm_check.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet::ops {
namespace {

using fp8::ScalingMode;
using octet::testing::fresh_seed;
using testing::expect_error;
using testing::make_fp8;
using testing::Values;

// ----------------------------------------------------------------------------
// The CPU contract's exact order (src/ops/cpu/gemm.cc), pinned with values whose rounding
// depends on it. The CUDA backend is measured against the CPU within tolerances instead.

/// 2^24: the first f32 at which adding 1 is a tie (rounded to even, so lost).
constexpr float kTwo24 = 16777216.0f;

/// D [1, 1] = A [1, k] x B [k, 1] on the CPU, f32, with `args`.
float cpu_dot(const std::vector<float>& a, const std::vector<float>& b, const GemmArgs& args = {},
              float d_old = 0.0f) {
  const auto k = static_cast<int64_t>(a.size());
  const Tensor d = Tensor::from_vector({d_old}, {1, 1});
  gemm(GemmOperand::dense(Tensor::from_vector(a, {1, k})),
       GemmOperand::dense(Tensor::from_vector(b, {k, 1})), d, args);
  return d.data<float>()[0];
}

TEST(GemmCpuContract, SumsKInIncreasingOrderInOneF32Accumulator) {
  // Spread over several K slices of the blocked kernel: 2^24, then + 1 (lost), then - 2^24.
  // In increasing order that is 0; any other order or a wider accumulator gives 1.
  constexpr int64_t kK = 700;
  std::vector<float> a(kK, 1.0f), b(kK, 0.0f);
  b[0] = kTwo24;
  b[300] = 1.0f;
  b[kK - 1] = -kTwo24;
  EXPECT_EQ(fp8::float_bits(cpu_dot(a, b)), fp8::float_bits(0.0f));
}

TEST(GemmCpuContract, RoundsEachProductBeforeAdding) {
  // (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 rounds (a tie, to even) to 1 + 2^-11, which cancels the
  // first term exactly; a fused multiply-add would keep 2^-24.
  const float x = 1.0f + std::ldexp(1.0f, -12);
  EXPECT_EQ(fp8::float_bits(cpu_dot({1.0f, x}, {-(1.0f + std::ldexp(1.0f, -11)), x})),
            fp8::float_bits(0.0f));
}

TEST(GemmCpuContract, EpilogueIsAlphaAccThenBetaDThenBias) {
  // 1 + 2^24 rounds to 2^24 (a tie, to even), then the bias -2^24 gives 0; adding the bias to
  // beta * D first would give 1.
  GemmArgs args;
  args.beta = 1.0f;
  args.bias = Tensor::from_vector({-kTwo24}, {1});
  EXPECT_EQ(fp8::float_bits(cpu_dot({1.0f}, {1.0f}, args, kTwo24)), fp8::float_bits(0.0f));
  // alpha scales the sum before beta * D joins it: 0.5 * 3 + 2 * 1.25 = 4 exactly.
  args = GemmArgs{};
  args.alpha = 0.5f;
  args.beta = 2.0f;
  EXPECT_EQ(cpu_dot({1.0f, 2.0f}, {1.0f, 1.0f}, args, 1.25f), 4.0f);
}

TEST(GemmCpuContract, AddendJoinsAfterTheBias) {
  // 1 + 2^24 rounds to 2^24 (a tie, to even), then the addend -2^24 gives 0; adding the addend
  // before the bias would give 1.
  GemmArgs args;
  args.bias = Tensor::from_vector({kTwo24}, {1});
  args.addend = Tensor::from_vector({-kTwo24}, {1, 1});
  EXPECT_EQ(fp8::float_bits(cpu_dot({1.0f}, {1.0f}, args)), fp8::float_bits(0.0f));
}

TEST(GemmCpuContract, AddendOnAnF32OutputIsTheGemmThenAnAdd) {
  // For an f32 D, rounding the product to D's dtype changes nothing, and the addend joins last:
  // bitwise the GEMM with its bias followed by ops::add, on random inputs.
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  constexpr int64_t kM = 37, kN = 45, kK = 301;  // partial micro-tiles and K slices
  const GemmOperand a =
      GemmOperand::dense(octet::testing::random_tensor({kM, kK}, DType::f32, seed));
  const GemmOperand b =
      GemmOperand::dense(octet::testing::random_tensor({kN, kK}, DType::f32, seed + 1), true);
  GemmArgs args;
  args.alpha = 0.75f;
  args.bias = octet::testing::random_tensor({kN}, DType::f32, seed + 2);
  const Tensor addend = octet::testing::random_tensor({kM, kN}, DType::f32, seed + 3, 8.0f);
  const Tensor separate = Tensor::empty({kM, kN}, DType::f32);
  gemm(a, b, separate, args);
  add(separate, addend, separate);
  args.addend = addend;
  const Tensor fused = Tensor::empty({kM, kN}, DType::f32);
  gemm(a, b, fused, args);
  EXPECT_TRUE(octet::testing::bitwise_equal(separate, fused));
}

TEST(GemmCpuContract, AddendRoundsABf16ProductFirst) {
  // acc = 257 lies halfway between the BF16 values 256 and 258 and rounds to even, 256, so with
  // the addend -256 a BF16 D holds 0 (the product is rounded to D's dtype before bias and addend
  // join it); without that rounding it would hold 1. A bias of -256 without an addend keeps the
  // single rounding: 1.
  const GemmOperand a = GemmOperand::dense(Tensor::from_vector({1.0f, 1.0f}, {1, 2}));
  const GemmOperand b = GemmOperand::dense(Tensor::from_vector({256.0f, 1.0f}, {2, 1}));
  constexpr float kMinus256 = -256.0f;
  auto run = [&](const GemmArgs& args) {
    const Tensor d = Tensor::empty({1, 1}, DType::bf16);
    gemm(a, b, d, args);
    return octet::testing::to_floats(d)[0];
  };
  GemmArgs with_addend;
  with_addend.addend = Tensor::empty({1, 1}, DType::bf16);
  static_cast<uint16_t*>(with_addend.addend.raw_data())[0] = fp8::encode_bf16(kMinus256);
  EXPECT_EQ(run(with_addend), 0.0f);
  GemmArgs with_bias;
  with_bias.bias = Tensor::from_vector({kMinus256}, {1});
  EXPECT_EQ(run(with_bias), 1.0f);
}

TEST(GemmCpuContract, Fp8ValueIsDecodedTimesScaleOfItsBlock) {
  // A [16, 256] block_1x128 x B [16, 256] block_128x128: every A byte encodes 1, every B byte 2;
  // A's scales differ per (row, 128-block), B's per 128x128 tile, so D[m, n] is
  // 2 * 128 * (sa[m, 0] * sb[0, 0] + sa[m, 1] * sb[0, 1]).
  constexpr int64_t kM = 16, kN = 16, kK = 256;
  fp8::QuantizedTensor qa = fp8::QuantizedTensor::allocate(
      kM, kK, DType::e4m3, ScalingMode::block_1x128, {}, Device::cpu());
  fp8::QuantizedTensor qb = fp8::QuantizedTensor::allocate(
      kN, kK, DType::e5m2, ScalingMode::block_128x128, {}, Device::cpu());
  std::memset(qa.data.raw_data(), fp8::encode_e4m3(1.0f), qa.data.nbytes());
  std::memset(qb.data.raw_data(), fp8::encode_e5m2(2.0f), qb.data.nbytes());
  float* sa = qa.scale_inv.data<float>();  // [16, 2]
  for (int64_t m = 0; m < kM; ++m) {
    sa[2 * m] = static_cast<float>(m + 1);
    sa[2 * m + 1] = 0.25f;
  }
  float* sb = qb.scale_inv.data<float>();  // [1, 2]
  sb[0] = 0.5f;
  sb[1] = 8.0f;
  const Tensor d = Tensor::empty({kM, kN}, DType::f32);
  gemm(GemmOperand::fp8(qa, false), GemmOperand::fp8(qb, false, true), d);
  for (int64_t m = 0; m < kM; ++m)
    for (int64_t n = 0; n < kN; ++n)
      EXPECT_EQ(d.data<float>()[m * kN + n], 2.0f * 128 * ((m + 1) * 0.5f + 0.25f * 8.0f))
          << "D[" << m << ", " << n << "]";
}

// ----------------------------------------------------------------------------
// Operand factories

TEST(GemmOperand, DenseKeepsDataAndTranspose) {
  const Tensor t = octet::testing::random_tensor({3, 5}, DType::bf16, fresh_seed());
  const GemmOperand op = GemmOperand::dense(t, true);
  EXPECT_EQ(op.data.raw_data(), t.raw_data());
  EXPECT_TRUE(op.transpose);
  EXPECT_FALSE(op.scale_inv.defined());
}

TEST(GemmOperand, Fp8PicksTheRequestedCopy) {
  const fp8::QuantizedTensor q = fp8::QuantizedTensor::allocate(
      32, 64, DType::e4m3, ScalingMode::block_1x128, {true, true}, Device::cpu());
  const GemmOperand row = GemmOperand::fp8(q, false, false);
  EXPECT_EQ(row.data.raw_data(), q.data.raw_data());
  EXPECT_EQ(row.scale_inv.raw_data(), q.scale_inv.raw_data());
  EXPECT_EQ(row.mode, ScalingMode::block_1x128);
  EXPECT_FALSE(row.transpose);
  const GemmOperand col = GemmOperand::fp8(q, true, true);
  EXPECT_EQ(col.data.raw_data(), q.data_t.raw_data());
  EXPECT_EQ(col.scale_inv.raw_data(), q.scale_inv_t.raw_data());
  EXPECT_TRUE(col.transpose);
}

TEST(GemmOperand, Fp8RefusesAMissingCopy) {
  const fp8::QuantizedTensor q = fp8::QuantizedTensor::allocate(
      32, 64, DType::e4m3, ScalingMode::per_tensor, {true, false}, Device::cpu());
  expect_error([&] { GemmOperand::fp8(q, true); }, {"transposed (columnwise) copy"});
}

// ----------------------------------------------------------------------------
// Bad input: the message names what was expected and what was received

Tensor f32_matrix(const Shape& shape) {
  return octet::testing::random_tensor(shape, DType::f32, fresh_seed());
}

/// A TN FP8 pair (A [m, k], B [n, k]) with valid per-tensor scales.
std::pair<GemmOperand, GemmOperand> fp8_pair(int64_t m, int64_t n, int64_t k,
                                             ScalingMode a_mode = ScalingMode::per_tensor,
                                             ScalingMode b_mode = ScalingMode::per_tensor) {
  const uint64_t seed = fresh_seed();
  return {make_fp8(m, k, DType::e4m3, a_mode, false, Values::integer, seed).op,
          make_fp8(n, k, DType::e4m3, b_mode, true, Values::integer, seed + 1).op};
}

TEST(GemmErrors, InnerDimensionsDiffer) {
  const Tensor d = Tensor::empty({4, 3}, DType::f32);
  expect_error(
      [&] {
        gemm(GemmOperand::dense(f32_matrix({4, 5})), GemmOperand::dense(f32_matrix({6, 3})), d);
      },
      {"inner dimensions", "op(A) is [4, 5]", "op(B) is [6, 3]"});
  // The transpose flag decides which extent is inner.
  expect_error(
      [&] {
        gemm(GemmOperand::dense(f32_matrix({4, 5}), true), GemmOperand::dense(f32_matrix({5, 3})),
             Tensor::empty({5, 3}, DType::f32));
      },
      {"inner dimensions", "transposed", "op(A) is [5, 4]"});
}

TEST(GemmErrors, WrongOutputAndBiasShapes) {
  const GemmOperand a = GemmOperand::dense(f32_matrix({4, 5}));
  const GemmOperand b = GemmOperand::dense(f32_matrix({5, 3}));
  expect_error(
      [&] {
        gemm(a, b, Tensor::empty({3, 4}, DType::f32));
      },
      {"D shape: expected [4, 3]", "f32[3, 4]"});
  GemmArgs args;
  args.bias = Tensor::empty({4}, DType::f32);
  expect_error(
      [&] {
        gemm(a, b, Tensor::empty({4, 3}, DType::f32), args);
      },
      {"bias shape: expected [3]", "f32[4]"});
}

TEST(GemmErrors, AddendMustMatchDAndStayApartFromIt) {
  const GemmOperand a = GemmOperand::dense(f32_matrix({4, 5}));
  const GemmOperand b = GemmOperand::dense(f32_matrix({5, 3}));
  const Tensor d = Tensor::empty({4, 3}, DType::f32);
  GemmArgs args;
  args.addend = f32_matrix({3, 4});
  expect_error([&] { gemm(a, b, d, args); }, {"addend shape: expected [4, 3]", "got f32[3, 4]"});
  args.addend = octet::testing::random_tensor({4, 3}, DType::bf16, fresh_seed());
  expect_error([&] { gemm(a, b, d, args); },
               {"addend dtype: expected D's dtype f32", "got bf16[4, 3]"});
  args.addend = f32_matrix({4, 3});
  args.beta = 1.0f;
  expect_error([&] { gemm(a, b, d, args); }, {"an addend and beta = 1 are exclusive"});
  args.beta = 0.0f;
  args.addend = d;
  expect_error([&] { gemm(a, b, d, args); },
               {"must not share memory with D", "f32[4, 3]", "use beta = 1"});
  // Rows 1..4 of one buffer as the addend, rows 0..3 as D: a partial overlap.
  const Tensor buffer = Tensor::zeros({8, 3}, DType::f32);
  args.addend = buffer.slice(1, 5);
  expect_error([&] { gemm(a, b, buffer.slice(0, 4), args); }, {"must not share memory with D"});
  // Adjacent rows of the same buffer are apart: D = A B + addend.
  const Tensor addend_values = f32_matrix({4, 3});
  Tensor(buffer.slice(4, 8)).copy_from(addend_values);
  args.addend = buffer.slice(4, 8);
  gemm(a, b, buffer.slice(0, 4), args);
  const Tensor product = Tensor::empty({4, 3}, DType::f32);
  gemm(a, b, product);
  add(product, addend_values, product);
  EXPECT_TRUE(octet::testing::bitwise_equal(product, buffer.slice(0, 4)));
}

TEST(GemmErrors, UnsupportedDtypes) {
  const Tensor d = Tensor::empty({4, 3}, DType::f32);
  const Tensor i32_a = Tensor::zeros({4, 5}, DType::i32);
  const Tensor i32_b = Tensor::zeros({5, 3}, DType::i32);
  expect_error([&] { gemm(GemmOperand::dense(i32_a), GemmOperand::dense(i32_b), d); },
               {"unsupported dtypes A i32 x B i32", "expected f32 x f32, bf16 x bf16"});
  const Tensor bf16_b = octet::testing::random_tensor({5, 3}, DType::bf16, fresh_seed());
  expect_error(
      [&] {
        gemm(GemmOperand::dense(f32_matrix({4, 5})), GemmOperand::dense(bf16_b), d);
      },
      {"share a dtype", "A f32 x B bf16"});
  expect_error(
      [&] {
        gemm(GemmOperand::dense(f32_matrix({4, 5})), GemmOperand::dense(f32_matrix({5, 3})),
             Tensor::empty({4, 3}, DType::i32));
      },
      {"unsupported D dtype i32", "expected f32 or bf16"});
  GemmArgs args;
  args.bias = Tensor::zeros({3}, DType::i32);
  expect_error(
      [&] {
        gemm(GemmOperand::dense(f32_matrix({4, 5})), GemmOperand::dense(f32_matrix({5, 3})), d,
             args);
      },
      {"unsupported bias dtype i32"});

  const uint64_t seed = fresh_seed();
  const GemmOperand e5_a =
      make_fp8(16, 32, DType::e5m2, ScalingMode::per_tensor, false, Values::integer, seed).op;
  const GemmOperand e5_b =
      make_fp8(16, 32, DType::e5m2, ScalingMode::per_tensor, true, Values::integer, seed + 1).op;
  expect_error(
      [&] {
        gemm(e5_a, e5_b, Tensor::empty({16, 16}, DType::f32));
      },
      {"A e5m2 x B e5m2", "expected e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3"});
  const Tensor bf16_bt = octet::testing::random_tensor({16, 32}, DType::bf16, seed);
  expect_error(
      [&] {
        gemm(e5_a, GemmOperand::dense(bf16_bt, true), Tensor::empty({16, 16}, DType::f32));
      },
      {"unsupported dtypes A e5m2 x B bf16"});
}

TEST(GemmErrors, Fp8DimsMustBeMultiplesOf16) {
  auto [a, b] = fp8_pair(16, 16, 24);
  expect_error(
      [&] {
        gemm(a, b, Tensor::empty({16, 16}, DType::f32));
      },
      {"multiple of 16", "M=16, N=16, K=24"});
  auto [a2, b2] = fp8_pair(20, 48, 32);
  expect_error(
      [&] {
        gemm(a2, b2, Tensor::empty({20, 48}, DType::bf16));
      },
      {"multiple of 16", "M=20"});
}

TEST(GemmErrors, Fp8NeedsTnLayout) {
  auto [a, b] = fp8_pair(32, 32, 32);
  const Tensor d = Tensor::empty({32, 32}, DType::f32);
  GemmOperand at = a;
  at.transpose = true;
  expect_error([&] { gemm(at, b, d); }, {"TN layout", "got A transposed and B transposed"});
  GemmOperand bn = b;
  bn.transpose = false;
  expect_error([&] { gemm(a, bn, d); }, {"TN layout", "got A not transposed and B not transposed"});
}

TEST(GemmErrors, Fp8ScalingModesMustMatch) {
  const Tensor d = Tensor::empty({128, 128}, DType::f32);
  const std::vector<std::array<ScalingMode, 2>> bad = {
      {ScalingMode::per_tensor, ScalingMode::block_1x128},
      {ScalingMode::block_128x128, ScalingMode::block_1x128},
      {ScalingMode::block_1x128, ScalingMode::mxfp8_1x32},
      {ScalingMode::mxfp8_1x32, ScalingMode::per_tensor}};
  for (const auto& [a_mode, b_mode] : bad) {
    auto [a, b] = fp8_pair(128, 128, 128, a_mode, b_mode);
    const std::string expected = std::string("scaling modes A ") +
                                 std::string(fp8::scaling_mode_name(a_mode)) + " x B " +
                                 std::string(fp8::scaling_mode_name(b_mode));
    expect_error([&] { gemm(a, b, d); }, {expected.c_str(), "expected per_tensor x per_tensor"});
  }
}

TEST(GemmErrors, Fp8ScaleInvMustFitModeAndData) {
  const Tensor d = Tensor::empty({16, 32}, DType::f32);
  auto [a, b] = fp8_pair(16, 32, 256, ScalingMode::block_1x128, ScalingMode::block_1x128);
  GemmOperand bad_shape = b;
  bad_shape.scale_inv = Tensor::zeros({32, 1}, DType::f32);
  expect_error([&] { gemm(a, bad_shape, d); },
               {"scale_inv of B under block_1x128", "expected f32[32, 2]", "got f32[32, 1]"});
  auto [ma, mb] = fp8_pair(16, 32, 256, ScalingMode::mxfp8_1x32, ScalingMode::mxfp8_1x32);
  GemmOperand bad_dtype = ma;
  bad_dtype.scale_inv = Tensor::zeros({16, 8}, DType::f32);
  expect_error([&] { gemm(bad_dtype, mb, d); }, {"scale_inv of A", "expected e8m0[16, 8]"});
  GemmOperand missing = a;
  missing.scale_inv = Tensor();
  expect_error([&] { gemm(missing, b, d); }, {"FP8 operand A", "needs scale_inv"});
  GemmOperand dense_with_scale = GemmOperand::dense(f32_matrix({16, 256}));
  dense_with_scale.scale_inv = Tensor::zeros({1}, DType::f32);
  expect_error(
      [&] {
        gemm(dense_with_scale, GemmOperand::dense(f32_matrix({32, 256}), true), d);
      },
      {"dense operand A", "must not carry scale_inv"});
}

TEST(GemmErrors, EmptyAndUndefinedTensors) {
  const GemmOperand a = GemmOperand::dense(f32_matrix({4, 5}));
  const GemmOperand b = GemmOperand::dense(f32_matrix({5, 3}));
  const Tensor d = Tensor::empty({4, 3}, DType::f32);
  expect_error(
      [&] {
        gemm(GemmOperand::dense(Tensor::empty({0, 5}, DType::f32)), b, d);
      },
      {"operand A is empty", "f32[0, 5]"});
  expect_error(
      [&] {
        gemm(a, GemmOperand::dense(Tensor::empty({5, 0}, DType::f32)), d);
      },
      {"operand B is empty", "f32[5, 0]"});
  expect_error(
      [&] {
        gemm(a, b, Tensor::empty({4, 0}, DType::f32));
      },
      {"output D is empty", "f32[4, 0]"});
  expect_error([&] { gemm(GemmOperand{}, b, d); }, {"operand A has no data"});
  expect_error([&] { gemm(a, b, Tensor()); }, {"output D is an undefined tensor"});
}

TEST(GemmErrors, TensorsOnDifferentDevices) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const GemmOperand a = GemmOperand::dense(f32_matrix({4, 5}));
  const GemmOperand b = GemmOperand::dense(f32_matrix({5, 3}));
  expect_error(
      [&] {
        gemm(a, GemmOperand::dense(b.data.to(gpu)), Tensor::empty({4, 3}, DType::f32));
      },
      {"all tensors must be on one device", "f32[4, 5] on cpu", "f32[5, 3] on cuda:0"});
  GemmArgs args;
  args.bias = Tensor::zeros({3}, DType::f32, gpu);
  expect_error(
      [&] {
        gemm(a, b, Tensor::empty({4, 3}, DType::f32), args);
      },
      {"all tensors must be on one device", "f32[3] on cuda:0"});
  GemmArgs addend_elsewhere;
  addend_elsewhere.addend = f32_matrix({4, 3}).to(gpu);
  expect_error(
      [&] {
        gemm(a, b, Tensor::empty({4, 3}, DType::f32), addend_elsewhere);
      },
      {"all tensors must be on one device", "f32[4, 3] on cuda:0"});
  auto [fa, fb] = fp8_pair(16, 16, 32);
  GemmOperand scales_elsewhere = fa;  // data on the GPU, scale_inv left on the CPU
  scales_elsewhere.data = fa.data.to(gpu);
  const Tensor d_gpu = Tensor::empty({16, 16}, DType::f32, gpu);
  expect_error(
      [&] {
        gemm(scales_elsewhere,
             GemmOperand{fb.data.to(gpu), fb.scale_inv.to(gpu), fb.mode, fb.transpose}, d_gpu);
      },
      {"all tensors must be on one device", "on cuda:0", "on cpu"});
}

}  // namespace
}  // namespace octet::ops
