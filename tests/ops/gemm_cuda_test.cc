// CUDA-specific GEMM tests: the cuBLASLt algorithm cache, determinism, MXFP8 emulation, block
// scales, the bias, beta and addend paths and the device check. They call the CUDA backend
// (octet::ops::cuda::gemm) directly with a resolved GemmShape; the parity suite against the CPU
// reference lives with the dispatcher. Without a GPU every case skips itself.
#include <gtest/gtest.h>

#if OCTET_WITH_CUDA

#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/int_math.h"
#include "octet/core/cuda_context.h"
#include "octet/core/determinism.h"
#include "octet/fp8/format.h"
#include "ops/cuda/cublaslt.h"
#include "ops/gemm_backend.h"
#include "test_util.h"

namespace octet::ops {
namespace {

using fp8::ScalingMode;
using testing::bitwise_equal;
using testing::fresh_seed;
using testing::to_bytes;
using testing::to_floats;

const Device kGpu = Device::cuda(0);

using Dims = std::array<int64_t, 3>;  ///< m, n, k

/// Requests determinism for one scope (the API flag; OCTET_DETERMINISTIC may also be set).
struct DeterministicScope {
  DeterministicScope() { set_deterministic(true); }
  ~DeterministicScope() { set_deterministic(false); }
};

::testing::AssertionResult message_contains(const Error& e, const std::string& text) {
  if (std::string(e.what()).find(text) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "message \"" << e.what() << "\" lacks \"" << text << "\"";
}

bool has_fp8_tensor_cores(const Device& device) {
  const cudaDeviceProp& props = octet::cuda::properties(device);
  return props.major * 10 + props.minor >= 89;
}

GemmOperand operand(const Tensor& data, bool transpose, Tensor scale_inv = {},
                    ScalingMode mode = ScalingMode::per_tensor) {
  GemmOperand x;
  x.data = data;
  x.scale_inv = scale_inv;
  x.mode = mode;
  x.transpose = transpose;
  return x;
}

/// An FP8 matrix built on the host: its GPU copy and the values it stands for.
struct Fp8Matrix {
  GemmOperand op;
  std::vector<float> values;  ///< dequantized, row-major as stored
  Tensor host_data, host_scales;
};

/// FP8 [rows, cols] with scales of `mode`. Elements are fp8(uniform(-range, range)), or small
/// integers in [-range, range] when `integers`; block scales are powers of two in 2^[-3, 3].
Fp8Matrix make_fp8(int64_t rows, int64_t cols, DType dtype, ScalingMode mode, bool transpose,
                   uint64_t seed, float range, bool integers, float per_tensor_scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> real(-range, range);
  std::uniform_int_distribution<int> integer(-static_cast<int>(range), static_cast<int>(range));
  std::uniform_int_distribution<int> exponent(-3, 3);
  Fp8Matrix m;
  m.host_data = Tensor::empty({rows, cols}, dtype);
  auto* q = static_cast<uint8_t*>(m.host_data.raw_data());
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float v = integers ? static_cast<float>(integer(rng)) : real(rng);
    q[i] = fp8::encode_fp8(v, dtype);
  }
  m.host_scales = Tensor::empty(fp8::scale_shape(mode, rows, cols), fp8::scale_dtype(mode));
  const int64_t n_scales = m.host_scales.numel();
  if (mode == ScalingMode::mxfp8_1x32) {
    auto* s = static_cast<uint8_t*>(m.host_scales.raw_data());
    for (int64_t i = 0; i < n_scales; ++i)
      s[i] = static_cast<uint8_t>(fp8::kE8M0Bias + exponent(rng));
  } else {
    float* s = m.host_scales.data<float>();
    for (int64_t i = 0; i < n_scales; ++i) {
      s[i] = mode == ScalingMode::per_tensor ? per_tensor_scale : std::ldexp(1.0f, exponent(rng));
    }
  }
  const int64_t blocks128 = ceil_div(cols, fp8::kBlock);
  const int64_t blocks32 = ceil_div(cols, fp8::kMxBlock);
  m.values.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float scale = 0.0f;
      switch (mode) {
        case ScalingMode::per_tensor:
          scale = m.host_scales.data<float>()[0];
          break;
        case ScalingMode::block_1x128:
          scale = m.host_scales.data<float>()[r * blocks128 + c / fp8::kBlock];
          break;
        case ScalingMode::block_128x128:
          scale = m.host_scales.data<float>()[(r / fp8::kBlock) * blocks128 + c / fp8::kBlock];
          break;
        case ScalingMode::mxfp8_1x32:
          scale = fp8::decode_e8m0(static_cast<const uint8_t*>(
              m.host_scales.raw_data())[r * blocks32 + c / fp8::kMxBlock]);
          break;
      }
      m.values[r * cols + c] = fp8::decode_fp8(q[r * cols + c], dtype) * scale;
    }
  }
  m.op = operand(m.host_data.to(kGpu), transpose, m.host_scales.to(kGpu), mode);
  return m;
}

/// op(A) op(B) in double from row-major values as stored (A [M, K] or, transposed, [K, M]).
std::vector<double> reference_product(const std::vector<float>& a, bool ta,
                                      const std::vector<float>& b, bool tb, int64_t m, int64_t n,
                                      int64_t k) {
  std::vector<double> d(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        const double x = ta ? a[p * m + i] : a[i * k + p];
        const double y = tb ? b[j * k + p] : b[p * n + j];
        sum += x * y;
      }
      d[i * n + j] = sum;
    }
  }
  return d;
}

/// The value of D's dtype nearest to each reference value, as a host tensor.
Tensor rounded(const std::vector<double>& values, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  for (size_t i = 0; i < values.size(); ++i) {
    const float v = static_cast<float>(values[i]);
    if (dtype == DType::f32) {
      t.data<float>()[i] = v;
    } else {
      static_cast<uint16_t*>(t.raw_data())[i] = fp8::encode_bf16(v);
    }
  }
  return t;
}

double relative_l2(const std::vector<float>& actual, const std::vector<double>& reference) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < reference.size(); ++i) {
    diff += (actual[i] - reference[i]) * (actual[i] - reference[i]);
    norm += reference[i] * reference[i];
  }
  return std::sqrt(diff / norm);
}

// ---------------------------------------------------------------------------------------------
// The algorithm cache: the first call per key asks the heuristic, later calls do not.

TEST(GemmCudaCache, OnlyTheFirstCallPerKeyQueriesTheHeuristic) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  // A shape no other test (nor an earlier --gtest_repeat round) uses, so the first call misses.
  static int64_t round = 0;
  const int64_t M = 80 + 32 * round++;
  constexpr int64_t N = 48, K = 96;
  auto run = [&](int64_t m, uint64_t s) {
    Tensor a = testing::random_int_tensor({m, K}, DType::bf16, s, 2);
    Tensor b = testing::random_int_tensor({K, N}, DType::bf16, s + 1, 2);
    Tensor d = Tensor::empty({m, N}, DType::f32, kGpu);
    cuda::gemm(operand(a.to(kGpu), false), operand(b.to(kGpu), false), d, {}, {m, N, K});
    const std::vector<double> expected =
        reference_product(to_floats(a), false, to_floats(b), false, m, N, K);
    EXPECT_TRUE(bitwise_equal(rounded(expected, {m, N}, DType::f32), d));
  };
  const size_t entries = cuda::gemm_cache_size();
  const uint64_t queries = cuda::gemm_heuristic_queries();
  run(M, seed);
  EXPECT_EQ(cuda::gemm_cache_size(), entries + 1);
  EXPECT_GT(cuda::gemm_heuristic_queries(), queries);

  const uint64_t queries_after_miss = cuda::gemm_heuristic_queries();
  run(M, seed + 7);  // new tensors, same key
  run(M, seed + 9);
  EXPECT_EQ(cuda::gemm_cache_size(), entries + 1);
  EXPECT_EQ(cuda::gemm_heuristic_queries(), queries_after_miss);

  run(M + 16, seed + 11);  // another shape is another key
  EXPECT_EQ(cuda::gemm_cache_size(), entries + 2);
  EXPECT_GT(cuda::gemm_heuristic_queries(), queries_after_miss);
}

TEST(GemmCudaCache, AnAddendIsPartOfTheKey) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  static int64_t round = 0;  // a fresh shape per --gtest_repeat round, as above
  const int64_t M = 1040 + 32 * round++;
  constexpr int64_t N = 80, K = 64;
  const Tensor a = testing::random_tensor({M, K}, DType::bf16, seed).to(kGpu);
  const Tensor b = testing::random_tensor({N, K}, DType::bf16, seed + 1).to(kGpu);
  const Tensor addend = testing::random_tensor({M, N}, DType::bf16, seed + 2).to(kGpu);
  auto run = [&](bool with_addend) {
    GemmArgs args;
    if (with_addend) args.addend = addend;
    Tensor d = Tensor::empty({M, N}, DType::bf16, kGpu);
    cuda::gemm(operand(a, false), operand(b, true), d, args, {M, N, K});
    return d;
  };
  const size_t entries = cuda::gemm_cache_size();
  const Tensor plain = run(false);
  EXPECT_EQ(cuda::gemm_cache_size(), entries + 1);
  const uint64_t queries = cuda::gemm_heuristic_queries();
  const Tensor fused = run(true);  // the same shape with C != D: its own entry and query
  EXPECT_EQ(cuda::gemm_cache_size(), entries + 2);
  EXPECT_GT(cuda::gemm_heuristic_queries(), queries);
  const uint64_t queries_after = cuda::gemm_heuristic_queries();
  run(true);
  EXPECT_EQ(cuda::gemm_cache_size(), entries + 2);
  EXPECT_EQ(cuda::gemm_heuristic_queries(), queries_after);
  // And the addend was added: D differs from the plain product wherever the addend is large.
  EXPECT_FALSE(bitwise_equal(plain, fused));
}

// ---------------------------------------------------------------------------------------------
// Dense operands: every transpose, exact with small integers (|sums| <= 256 stay exact even in a
// bf16 split-K partial).

struct DenseCase {
  DType in;
  DType out;
  bool ta, tb;
  int64_t m, n, k;
};

class GemmCudaDense : public ::testing::TestWithParam<DenseCase> {};

TEST_P(GemmCudaDense, SmallIntegersAreExact) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  const DenseCase c = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  Tensor a = testing::random_int_tensor(c.ta ? Shape{c.k, c.m} : Shape{c.m, c.k}, c.in, seed, 2);
  Tensor b =
      testing::random_int_tensor(c.tb ? Shape{c.n, c.k} : Shape{c.k, c.n}, c.in, seed + 1, 2);
  Tensor d = Tensor::empty({c.m, c.n}, c.out, kGpu);
  cuda::gemm(operand(a.to(kGpu), c.ta), operand(b.to(kGpu), c.tb), d, {}, {c.m, c.n, c.k});
  const std::vector<double> expected =
      reference_product(to_floats(a), c.ta, to_floats(b), c.tb, c.m, c.n, c.k);
  EXPECT_TRUE(bitwise_equal(rounded(expected, {c.m, c.n}, c.out), d));
}

std::vector<DenseCase> dense_cases() {
  std::vector<DenseCase> cases;
  for (DType in : {DType::f32, DType::bf16})
    for (DType out : {DType::f32, DType::bf16})
      for (bool ta : {false, true})
        for (bool tb : {false, true})
          for (auto [m, n, k] : {Dims{33, 17, 45}, Dims{64, 48, 64}})
            cases.push_back({in, out, ta, tb, m, n, k});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(All, GemmCudaDense, ::testing::ValuesIn(dense_cases()),
                         [](const ::testing::TestParamInfo<DenseCase>& info) {
                           const DenseCase& c = info.param;
                           return std::string(dtype_name(c.in)) + "_to_" +
                                  std::string(dtype_name(c.out)) + (c.ta ? "_T" : "_N") +
                                  (c.tb ? "T_" : "N_") + std::to_string(c.m) + "x" +
                                  std::to_string(c.n) + "x" + std::to_string(c.k);
                         });

// ---------------------------------------------------------------------------------------------
// Per-tensor FP8 (TN): scales, alpha, beta = 1 accumulation into D, an addend (C != D), and both
// bias paths (fused by cuBLASLt, or added by our kernel where cuBLASLt declines the bias type).
// Small integers with power-of-two scales keep every intermediate exact (BF16 included), so the
// result is compared bit for bit.

/// What joins the product besides the bias: nothing, beta * D (D's old contents), or an addend.
enum class Extra : uint8_t { none, beta, addend };

struct Fp8Case {
  DType a, b, out;
  int bias;  ///< 0: none, else the bias dtype's index (1: f32, 2: bf16)
  Extra extra;
  Accumulation accumulation;
};

class GemmCudaPerTensorFp8 : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(GemmCudaPerTensorFp8, ScalesBiasBetaAndAddendAreExact) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  const Fp8Case c = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  // |A B| <= 2 * 2 * 32 = 128; plus D (or the addend) and bias <= 136.
  constexpr int64_t M = 48, N = 32, K = 32;
  Fp8Matrix a = make_fp8(M, K, c.a, ScalingMode::per_tensor, false, seed, 2, true, 0.5f);
  Fp8Matrix b = make_fp8(N, K, c.b, ScalingMode::per_tensor, true, seed + 1, 2, true, 2.0f);
  // D's old contents for beta, or the addend; with an addend D starts as NaN (it is not read).
  Tensor d0 = testing::random_int_tensor({M, N}, c.out, seed + 2, 4);
  Tensor d = d0.to(kGpu);
  GemmArgs args;
  args.beta = c.extra == Extra::beta ? 1.0f : 0.0f;
  args.accumulation = c.accumulation;
  if (c.extra == Extra::addend) {
    args.addend = d0.to(kGpu);
    Tensor nan = Tensor::empty({M, N}, c.out);
    std::memset(nan.raw_data(), 0xFF, nan.nbytes());
    d = nan.to(kGpu);
  }
  Tensor bias;
  if (c.bias != 0) {
    bias = testing::random_int_tensor({N}, c.bias == 1 ? DType::f32 : DType::bf16, seed + 3, 4);
    args.bias = bias.to(kGpu);
  }
  if (!has_fp8_tensor_cores(kGpu)) {
    try {
      cuda::gemm(a.op, b.op, d, args, {M, N, K});
      FAIL() << "expected an error for FP8 on a GPU without FP8 tensor cores";
    } catch (const Error& e) {
      EXPECT_TRUE(message_contains(e, octet::cuda::properties(kGpu).name));
    }
    return;
  }
  cuda::gemm(a.op, b.op, d, args, {M, N, K});

  std::vector<double> expected = reference_product(a.values, false, b.values, true, M, N, K);
  const std::vector<float> old_d = to_floats(d0);
  const std::vector<float> bias_values = c.bias != 0 ? to_floats(bias) : std::vector<float>();
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double& v = expected[i * N + j];
      if (c.extra != Extra::none) v += old_d[i * N + j];
      if (c.bias != 0) v += bias_values[j];
    }
  }
  EXPECT_TRUE(bitwise_equal(rounded(expected, {M, N}, c.out), d));
  if (c.extra == Extra::addend) EXPECT_TRUE(bitwise_equal(d0, args.addend)) << "addend changed";
}

std::vector<Fp8Case> fp8_cases() {
  std::vector<Fp8Case> cases;
  const std::array<std::array<DType, 2>, 3> pairs = {
      {{DType::e4m3, DType::e4m3}, {DType::e4m3, DType::e5m2}, {DType::e5m2, DType::e4m3}}};
  for (auto [a, b] : pairs)
    for (DType out : {DType::f32, DType::bf16})
      for (int bias : {0, 1, 2})
        for (Extra extra : {Extra::none, Extra::beta, Extra::addend})
          for (Accumulation acc : {Accumulation::fast, Accumulation::split})
            cases.push_back({a, b, out, bias, extra, acc});
  return cases;
}

std::string fp8_case_name(const ::testing::TestParamInfo<Fp8Case>& info) {
  const Fp8Case& c = info.param;
  static const char* const kBias[] = {"nobias", "biasf32", "biasbf16"};
  static const char* const kExtra[] = {"_beta0", "_beta1", "_addend"};
  return std::string(dtype_name(c.a)) + "x" + std::string(dtype_name(c.b)) + "_to_" +
         std::string(dtype_name(c.out)) + "_" + kBias[c.bias] + kExtra[static_cast<int>(c.extra)] +
         (c.accumulation == Accumulation::fast ? "_fast" : "_split");
}

INSTANTIATE_TEST_SUITE_P(All, GemmCudaPerTensorFp8, ::testing::ValuesIn(fp8_cases()),
                         fp8_case_name);

// ---------------------------------------------------------------------------------------------
// The addend at the shape it is for (GPT-2 1.5B's attention projection, [tokens, 1600] x
// [1600, 1600]^T, bias and residual in BF16 as nn::Linear passes them): fused into cuBLASLt's
// epilogue on Hopper, with no separate pass, and within the CPU contract's tolerance.

/// CUDA against the CPU contract (the parity suite's bounds): FP8 fast accumulation, BF16 tensor
/// cores, and one BF16 rounding of the result that may land on the other side.
constexpr double kFastAccumulationRelL2 = 0.001953125;  // 2^-9
constexpr double kBf16TensorCoreRelL2 = 1e-5;
constexpr double kBf16OutputRelL2 = 0.00390625;  // 2^-8

class GemmCudaAddend : public ::testing::TestWithParam<DType> {};

TEST_P(GemmCudaAddend, FusesWithTheBiasOnHopperAndTracksTheCpuContract) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  const DType in = GetParam();
  if (is_fp8(in) && !has_fp8_tensor_cores(kGpu)) GTEST_SKIP() << "no FP8 tensor cores";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  constexpr int64_t M = 1024, N = 1600, K = 1600;
  GemmOperand a_host, b_host;
  if (is_fp8(in)) {
    const Fp8Matrix a = make_fp8(M, K, in, ScalingMode::per_tensor, false, seed, 4, false, 0.25f);
    const Fp8Matrix b = make_fp8(N, K, in, ScalingMode::per_tensor, true, seed + 1, 4, false, 0.5f);
    a_host = operand(a.host_data, false, a.host_scales);
    b_host = operand(b.host_data, true, b.host_scales);
  } else {
    a_host = operand(testing::random_tensor({M, K}, in, seed), false);
    b_host = operand(testing::random_tensor({N, K}, in, seed + 1), true);
  }
  auto on_gpu = [](const GemmOperand& x) {
    return operand(x.data.to(kGpu), x.transpose,
                   x.scale_inv.defined() ? x.scale_inv.to(kGpu) : Tensor(), x.mode);
  };
  GemmArgs host_args;
  host_args.accumulation = Accumulation::fast;  // a forward GEMM
  host_args.bias = testing::random_tensor({N}, DType::bf16, seed + 2);
  // The residual stream is larger than one layer's output.
  host_args.addend = testing::random_tensor({M, N}, DType::bf16, seed + 3, 8.0f);
  GemmArgs args = host_args;
  args.bias = host_args.bias.to(kGpu);
  args.addend = host_args.addend.to(kGpu);

  const uint64_t unfused = cuda::gemm_unfused_addends();
  Tensor d = Tensor::empty({M, N}, DType::bf16, kGpu);
  cuda::gemm(on_gpu(a_host), on_gpu(b_host), d, args, {M, N, K});
  if (octet::cuda::properties(kGpu).major == 9) {
    EXPECT_EQ(cuda::gemm_unfused_addends(), unfused)
        << "cuBLASLt declined the addend (C != D) with the BF16 bias epilogue";
  }
  EXPECT_TRUE(bitwise_equal(host_args.addend, args.addend)) << "the addend changed";

  Tensor d_cpu = Tensor::empty({M, N}, DType::bf16);
  gemm(a_host, b_host, d_cpu, host_args);
  const double tolerance =
      (is_fp8(in) ? kFastAccumulationRelL2 : kBf16TensorCoreRelL2) + kBf16OutputRelL2;
  std::vector<double> reference;
  for (float v : to_floats(d_cpu)) reference.push_back(v);
  EXPECT_LE(relative_l2(to_floats(d), reference), tolerance);
}

INSTANTIATE_TEST_SUITE_P(Gpt2Proj, GemmCudaAddend, ::testing::Values(DType::e4m3, DType::bf16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// Determinism: with determinism on, a split-K-prone shape (tiny M and N, huge K) gives the same
// bytes on every run. Bytes, not values: +0.0 == -0.0 would hide a difference.

class GemmCudaDeterminism : public ::testing::TestWithParam<DType> {};

TEST_P(GemmCudaDeterminism, RepeatedRunsAreBitwiseIdentical) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  const DType in = GetParam();
  if (is_fp8(in) && !has_fp8_tensor_cores(kGpu)) GTEST_SKIP() << "no FP8 tensor cores";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  constexpr int64_t M = 256, N = 256, K = 65536;
  constexpr int kRuns = 4;
  GemmOperand a, b;
  if (is_fp8(in)) {
    a = make_fp8(M, K, in, ScalingMode::per_tensor, false, seed, 4, false, 0.25f).op;
    b = make_fp8(N, K, in, ScalingMode::per_tensor, true, seed + 1, 4, false, 0.5f).op;
  } else {
    a = operand(testing::random_tensor({M, K}, in, seed).to(kGpu), false);
    b = operand(testing::random_tensor({N, K}, in, seed + 1).to(kGpu), true);
  }
  DeterministicScope deterministic;
  // Plain, then with an addend (its own algorithm, and the addend read in the epilogue).
  GemmArgs with_addend;
  with_addend.addend = testing::random_tensor({M, N}, DType::f32, seed + 2).to(kGpu);
  for (const GemmArgs& args : {GemmArgs{}, with_addend}) {
    SCOPED_TRACE(args.addend.defined() ? "with an addend" : "plain");
    std::vector<Tensor> runs;
    for (int r = 0; r < kRuns; ++r) {
      runs.push_back(Tensor::empty({M, N}, DType::f32, kGpu));
      cuda::gemm(a, b, runs.back(), args, {M, N, K});
    }
    for (float v : to_floats(runs[0])) ASSERT_TRUE(std::isfinite(v));
    for (int r = 1; r < kRuns; ++r) {
      SCOPED_TRACE("run " + std::to_string(r));
      EXPECT_TRUE(bitwise_equal(runs[0], runs[r]));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, GemmCudaDeterminism, ::testing::Values(DType::bf16, DType::e4m3),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// MXFP8: close to the exact product everywhere; where it is emulated (no native MXFP8 in
// cuBLASLt, e.g. Hopper), bit-identical to the BF16 GEMM of the dequantized operands.

struct MxCase {
  DType a, b, out;
};

class GemmCudaMxfp8 : public ::testing::TestWithParam<MxCase> {};

TEST_P(GemmCudaMxfp8, EmulationIsTheBf16GemmOfTheDequantizedOperands) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  if (!has_fp8_tensor_cores(kGpu)) GTEST_SKIP() << "no FP8 tensor cores";
  const MxCase c = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  constexpr int64_t M = 144, N = 192, K = 352;  // K / 32 = 11 blocks: padded scale tiles
  Fp8Matrix a = make_fp8(M, K, c.a, ScalingMode::mxfp8_1x32, false, seed, 2, false);
  Fp8Matrix b = make_fp8(N, K, c.b, ScalingMode::mxfp8_1x32, true, seed + 1, 2, false);
  GemmArgs args;
  args.alpha = 0.5f;
  DeterministicScope deterministic;  // the same algorithm on every call with this key

  const uint64_t emulations = cuda::gemm_mxfp8_emulations();
  Tensor d = Tensor::empty({M, N}, c.out, kGpu);
  cuda::gemm(a.op, b.op, d, args, {M, N, K});
  std::vector<double> expected = reference_product(a.values, false, b.values, true, M, N, K);
  for (double& v : expected) v *= args.alpha;
  EXPECT_LT(relative_l2(to_floats(d), expected), c.out == DType::f32 ? 1e-4 : 1e-2);

  if (cuda::gemm_mxfp8_emulations() == emulations) GTEST_SKIP() << "native MXFP8 on this GPU";
  auto bf16_copy = [](const std::vector<float>& values, const Shape& shape) {
    Tensor t = Tensor::empty(shape, DType::bf16);
    for (size_t i = 0; i < values.size(); ++i) {
      static_cast<uint16_t*>(t.raw_data())[i] = fp8::encode_bf16(values[i]);
    }
    return t.to(kGpu);
  };
  Tensor d_bf16 = Tensor::empty({M, N}, c.out, kGpu);
  cuda::gemm(operand(bf16_copy(a.values, {M, K}), false),
             operand(bf16_copy(b.values, {N, K}), true), d_bf16, args, {M, N, K});
  EXPECT_TRUE(bitwise_equal(d_bf16, d));
}

INSTANTIATE_TEST_SUITE_P(All, GemmCudaMxfp8,
                         ::testing::Values(MxCase{DType::e4m3, DType::e4m3, DType::f32},
                                           MxCase{DType::e4m3, DType::e4m3, DType::bf16},
                                           MxCase{DType::e4m3, DType::e5m2, DType::f32},
                                           MxCase{DType::e5m2, DType::e4m3, DType::bf16}),
                         [](const ::testing::TestParamInfo<MxCase>& info) {
                           return std::string(dtype_name(info.param.a)) + "x" +
                                  std::string(dtype_name(info.param.b)) + "_to_" +
                                  std::string(dtype_name(info.param.out));
                         });

// ---------------------------------------------------------------------------------------------
// Block scales (1x128 activations x 1x128 or 128x128 weights) against the exact product. The
// shapes have partial 128-row tiles and K-block counts that are not multiples of 4, so the scale
// layout conversions are exercised, not just the identity case.

struct BlockCase {
  ScalingMode b_mode;
  DType out;
  bool bias;
  int64_t m, n, k;
};

class GemmCudaBlockScaled : public ::testing::TestWithParam<BlockCase> {};

TEST_P(GemmCudaBlockScaled, MatchesTheExactProduct) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  if (!has_fp8_tensor_cores(kGpu)) GTEST_SKIP() << "no FP8 tensor cores";
  const BlockCase c = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  Fp8Matrix a = make_fp8(c.m, c.k, DType::e4m3, ScalingMode::block_1x128, false, seed, 4, false);
  Fp8Matrix b = make_fp8(c.n, c.k, DType::e4m3, c.b_mode, true, seed + 1, 4, false);
  GemmArgs args;
  args.accumulation = Accumulation::fast;  // block-scaled kernels accumulate split regardless
  Tensor bias;
  if (c.bias) {
    bias = testing::random_tensor({c.n}, DType::f32, seed + 2, 8.0f);
    args.bias = bias.to(kGpu);
  }
  Tensor d = Tensor::empty({c.m, c.n}, c.out, kGpu);
  try {
    cuda::gemm(a.op, b.op, d, args, {c.m, c.n, c.k});
  } catch (const Error& e) {
    // Block-scaled FP8 GEMMs exist in cuBLASLt for Hopper; elsewhere the refusal must be clear.
    if (octet::cuda::properties(kGpu).major == 9) throw;
    EXPECT_TRUE(message_contains(e, "does not support FP8 GEMMs with"));
    GTEST_SKIP() << e.what();
  }
  std::vector<double> expected = reference_product(a.values, false, b.values, true, c.m, c.n, c.k);
  if (c.bias) {
    const std::vector<float> bias_values = to_floats(bias);
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.n; ++j) expected[i * c.n + j] += bias_values[j];
  }
  // Hopper's FP8 tensor cores keep a narrower sum inside each 128-element block before it is
  // promoted to FP32; bf16 output adds its own rounding (2^-9). A wrong scale layout is O(1).
  EXPECT_LT(relative_l2(to_floats(d), expected), c.out == DType::f32 ? 2e-3 : 1e-2);
}

std::vector<BlockCase> block_cases() {
  std::vector<BlockCase> cases;
  for (ScalingMode mode : {ScalingMode::block_1x128, ScalingMode::block_128x128})
    for (DType out : {DType::f32, DType::bf16})
      for (bool bias : {false, true})
        for (auto [m, n, k] : {Dims{128, 256, 512}, Dims{48, 272, 640}})
          cases.push_back({mode, out, bias, m, n, k});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(All, GemmCudaBlockScaled, ::testing::ValuesIn(block_cases()),
                         [](const ::testing::TestParamInfo<BlockCase>& info) {
                           const BlockCase& c = info.param;
                           return "1x128_x_" + std::string(fp8::scaling_mode_name(c.b_mode)) +
                                  "_to_" + std::string(dtype_name(c.out)) +
                                  (c.bias ? "_bias_" : "_") + std::to_string(c.m) + "x" +
                                  std::to_string(c.n) + "x" + std::to_string(c.k);
                         });

// ---------------------------------------------------------------------------------------------
// Rule 2: no op mixes devices.

TEST(GemmCudaDevices, TensorsOnTwoGpusAreRejected) {
  if (cuda_device_count() < 2)
    GTEST_SKIP() << "needs 2 GPUs, " << cuda_device_count() << " visible";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  const Device other = Device::cuda(1);
  Tensor a = testing::random_tensor({32, 16}, DType::bf16, seed).to(other);
  Tensor b = testing::random_tensor({16, 48}, DType::bf16, seed + 1).to(kGpu);
  Tensor d = Tensor::zeros({32, 48}, DType::f32, kGpu);
  try {
    cuda::gemm(operand(a, false), operand(b, false), d, {}, {32, 48, 16});
    FAIL() << "expected an error for operands on cuda:1 and cuda:0";
  } catch (const Error& e) {
    EXPECT_TRUE(message_contains(e, "one device"));
    EXPECT_TRUE(message_contains(e, "cuda:1"));
    EXPECT_TRUE(message_contains(e, "cuda:0"));
  }
  // Nothing was written to D.
  for (float v : to_floats(d)) ASSERT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace octet::ops

#endif  // OCTET_WITH_CUDA
