// The cuDNN path of CUDA attention (OCTET_ATTENTION=cudnn, src/ops/cuda/attention_cudnn.cc): the
// same reference, tolerances and repeatability as the flash path's suite (attention_check.h),
// agreement with octet's own kernels, the fallback to them where cuDNN cannot take a call, and
// the parsing of the choice (CPU-runnable).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <optional>
#include <string>

#include "octet/core/device.h"
#include "octet/ops/attention.h"
#include "ops/attention_check.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using namespace testing::attention;  // the reference, tolerances and runs of attention_test.cc
using ops::AttentionChoice;
using ops::AttentionPath;
using ops::AttentionShape;
using ops::ScopedAttentionChoice;
using testing::expect_error;
using testing::fresh_seed;
using testing::on;
using testing::random_tensor;
using testing::relative_l2;
using testing::to_floats;

// ----------------------------------------------------------------------------
// The choice (no GPU needed)

TEST(AttentionChoice, ParsesTheValidValues) {
  EXPECT_EQ(ops::parse_attention_choice("flash"), AttentionChoice::flash);
  EXPECT_EQ(ops::parse_attention_choice("auto"), AttentionChoice::automatic);
  if (ops::cudnn_attention_built()) {
    EXPECT_EQ(ops::parse_attention_choice("cudnn"), AttentionChoice::cudnn);
  }
}

TEST(AttentionChoice, ABadValueListsTheValidOnes) {
  for (const char* bad : {"", "Flash", "cudnn ", "fa2", "simple"}) {
    SCOPED_TRACE(bad);
    expect_error([&] { ops::parse_attention_choice(bad); },
                 {"OCTET_ATTENTION", "valid values: flash, cudnn, auto (default)"});
  }
  // The message begins with where the text came from (the CLI passes its flag).
  expect_error([] { ops::parse_attention_choice("fa2", "--attention"); },
               {"--attention: unknown attention path 'fa2'"});
}

TEST(AttentionChoice, CudnnWithoutTheBuildNamesTheRemedy) {
  if (ops::cudnn_attention_built()) {
    GTEST_SKIP() << "this build has the cuDNN path (OCTET_WITH_CUDNN_ATTENTION), so cudnn parses";
  }
  expect_error([] { ops::parse_attention_choice("cudnn"); },
               {"OCTET_WITH_CUDNN_ATTENTION=ON", "scripts/cudnn-frontend.sh"});
  const AttentionChoice before = ops::attention_choice();
  expect_error([] { ops::set_attention_choice(AttentionChoice::cudnn); },
               {"OCTET_WITH_CUDNN_ATTENTION=ON"});
  EXPECT_EQ(ops::attention_choice(), before) << "a refused choice must not stick";
}

TEST(AttentionChoice, TheSetterOverridesAndRestores) {
  const AttentionChoice before = ops::attention_choice();
  {
    ScopedAttentionChoice automatic(AttentionChoice::automatic);
    EXPECT_EQ(ops::attention_choice(), AttentionChoice::automatic);
    {
      ScopedAttentionChoice flash(AttentionChoice::flash);
      EXPECT_EQ(ops::attention_choice(), AttentionChoice::flash);
    }
    EXPECT_EQ(ops::attention_choice(), AttentionChoice::automatic);
  }
  EXPECT_EQ(ops::attention_choice(), before);
}

TEST(AttentionChoice, PathsHaveNames) {
  EXPECT_STREQ(ops::attention_path_name(AttentionPath::flash), "flash");
  EXPECT_STREQ(ops::attention_path_name(AttentionPath::cudnn), "cudnn");
  EXPECT_STREQ(ops::attention_path_name(AttentionPath::simple), "simple");
}

// ----------------------------------------------------------------------------
// The cuDNN path on a GPU

/// GTEST_SKIP()s the calling test unless cuda:0 is there and this build has the cuDNN path.
#define OCTET_SKIP_WITHOUT_CUDNN_ATTENTION()                                                     \
  do {                                                                                           \
    OCTET_SKIP_IF_UNAVAILABLE(Device::cuda(0));                                                  \
    if (!ops::cudnn_attention_built())                                                           \
      GTEST_SKIP() << "built without the cuDNN attention path (OCTET_WITH_CUDNN_ATTENTION=OFF: " \
                      "run scripts/cudnn-frontend.sh, then reconfigure)";                        \
  } while (false)

const Device kGpu = Device::cuda(0);

std::string shape_name(const ::testing::TestParamInfo<AttentionShape>& info) {
  const AttentionShape& s = info.param;
  return "B" + std::to_string(s.batch) + "_T" + std::to_string(s.seq) + "_H" +
         std::to_string(s.heads) + "_D" + std::to_string(s.head_dim);
}

/// bf16 inputs on the GPU from one fresh seed.
struct GpuInputs {
  Tensor qkv_host, dout_host, qkv, dout;
};

/// Every test of the cuDNN path: skipped without the GPU or the build, run under
/// OCTET_ATTENTION=cudnn's choice, on fresh inputs whose seed every failure names.
class CudnnAttention : public ::testing::TestWithParam<AttentionShape> {
 protected:
  void SetUp() override {
    OCTET_SKIP_WITHOUT_CUDNN_ATTENTION();
    choice_.emplace(AttentionChoice::cudnn);
    const uint64_t seed = fresh_seed();
    trace_.emplace(__FILE__, __LINE__, ::testing::Message() << "seed " << seed);
    const AttentionShape& s = GetParam();
    in_.qkv_host = random_tensor(qkv_shape(s), DType::bf16, seed, kQkvRange);
    in_.dout_host = random_tensor(out_shape(s), DType::bf16, seed + 1);
    in_.qkv = on(in_.qkv_host, kGpu);
    in_.dout = on(in_.dout_host, kGpu);
    // A test of the cuDNN path that ran another path would prove nothing.
    ASSERT_EQ(ops::attention_path(in_.qkv, s), AttentionPath::cudnn);
  }

  std::optional<ScopedAttentionChoice> choice_;
  std::optional<::testing::ScopedTrace> trace_;
  GpuInputs in_;
};

TEST_P(CudnnAttention, ForwardMatchesReference) {
  const AttentionShape& s = GetParam();
  // lse at f32's bound: cuDNN's Stats must be the natural-log LSE of the scaled scores.
  const ForwardErrors errors = forward_errors(in_.qkv_host, run(in_.qkv, nullptr, s), s);
  EXPECT_LE(errors.out, kBf16Tolerance.out);
  EXPECT_LE(errors.lse, kBf16Tolerance.lse);
}

TEST_P(CudnnAttention, BackwardMatchesReferenceGradients) {
  const AttentionShape& s = GetParam();
  const std::array<double, 3> errors =
      backward_errors(in_.qkv_host, in_.dout_host, run(in_.qkv, &in_.dout, s), s);
  const char* names[3] = {"dq", "dk", "dv"};
  for (int64_t part : {kQ, kK, kV}) {
    SCOPED_TRACE(names[part]);
    EXPECT_LE(errors[part], kBf16Tolerance.grad);
  }
}

TEST_P(CudnnAttention, RunsAreBitwiseRepeatable) {
  expect_bitwise_repeatable(in_.qkv, in_.dout, GetParam());
}

/// cuDNN against octet's own kernels (flash where it fits, simple elsewhere) on the same inputs.
/// Each is within the bf16 tolerance of the exact result, so they are within twice it of each
/// other (lse: twice f32's bound, here relative to the norm of every query's lse, which over 96
/// queries or more is far from zero even where one query's scores cancel).
TEST_P(CudnnAttention, AgreesWithOctetsKernels) {
  const AttentionShape& s = GetParam();
  const Result by_cudnn = run(in_.qkv, &in_.dout, s);
  Result by_octet;
  {
    ScopedAttentionChoice flash(AttentionChoice::flash);
    EXPECT_NE(ops::attention_path(in_.qkv, s), AttentionPath::cudnn);
    by_octet = run(in_.qkv, &in_.dout, s);
  }
  constexpr double kPaths = 2;  // two independent errors, each within the tolerance
  EXPECT_LE(relative_l2(to_floats(by_cudnn.out), to_floats(by_octet.out)),
            kPaths * kBf16Tolerance.out);
  EXPECT_LE(relative_l2(to_floats(by_cudnn.lse), to_floats(by_octet.lse)),
            kPaths * kBf16Tolerance.lse);
  EXPECT_LE(relative_l2(to_floats(by_cudnn.dqkv), to_floats(by_octet.dqkv)),
            kPaths * kBf16Tolerance.grad);
}

/// The shapes the cuDNN path is checked at: small and large heads, a long sequence, a sequence
/// that is not a multiple of cuDNN's 64- and 128-row tiles, and a head_dim (96) that only cuDNN
/// and the simple path take.
INSTANTIATE_TEST_SUITE_P(Ops, CudnnAttention,
                         ::testing::Values(AttentionShape{2, 128, 4, 64},
                                           AttentionShape{1, 256, 3, 128},
                                           AttentionShape{2, 1024, 2, 64},
                                           AttentionShape{1, 200, 2, 64},
                                           AttentionShape{2, 96, 2, 96}),
                         shape_name);

/// The deterministic backward at a training shape (GPT-2 1.5B's heads, 8 x 1024 tokens), where its
/// dQ runs through the dP workspace over many CTAs: a float-atomic dQ would differ between some
/// of these runs. 8 runs (OCTET_TEST_REPEATS overrides); left out under OCTET_TEST_SMALL.
TEST(CudnnAttentionFieldShape, BackwardRepeatsByteForByte) {
  OCTET_SKIP_WITHOUT_CUDNN_ATTENTION();
  if (testing::small_tests_only()) GTEST_SKIP() << "OCTET_TEST_SMALL: a training shape";
  const ScopedAttentionChoice cudnn(AttentionChoice::cudnn);
  const AttentionShape s{8, 1024, 25, 64};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Tensor qkv = on(random_tensor(qkv_shape(s), DType::bf16, seed, kQkvRange), kGpu);
  const Tensor dout = on(random_tensor(out_shape(s), DType::bf16, seed + 1), kGpu);
  ASSERT_EQ(ops::attention_path(qkv, s), AttentionPath::cudnn);
  expect_bitwise_repeatable(qkv, dout, s, testing::repeats(8));
}

TEST(CudnnAttentionPath, FallsBackWhereCudnnCannotTakeTheCall) {
  OCTET_SKIP_WITHOUT_CUDNN_ATTENTION();
  const auto path = [](DType dtype, const AttentionShape& s) {
    return ops::attention_path(Tensor::zeros(qkv_shape(s), dtype, kGpu), s);
  };
  const AttentionShape d64{1, 16, 2, 64}, d96{1, 16, 2, 96}, d12{1, 16, 2, 12}, d256{1, 16, 1, 256};
  {
    ScopedAttentionChoice cudnn(AttentionChoice::cudnn);
    EXPECT_EQ(path(DType::bf16, d64), AttentionPath::cudnn);
    EXPECT_EQ(path(DType::bf16, d96), AttentionPath::cudnn);
    EXPECT_EQ(path(DType::f32, d64), AttentionPath::simple) << "cuDNN's path is bf16 only";
    EXPECT_EQ(path(DType::bf16, d12), AttentionPath::simple) << "head_dim not a multiple of 8";
    EXPECT_EQ(path(DType::bf16, d256), AttentionPath::simple) << "head_dim above 128";
    // A view 2 bytes into its storage: misaligned for cuDNN (and flash).
    const Tensor storage =
        Tensor::zeros({qkv_shape(d64)[0] * qkv_shape(d64)[1] + 1}, DType::bf16, kGpu);
    const Tensor shifted = storage.slice(1, storage.numel()).view(qkv_shape(d64));
    EXPECT_EQ(ops::attention_path(shifted, d64), AttentionPath::simple);
  }
  {
    ScopedAttentionChoice automatic(AttentionChoice::automatic);
    EXPECT_EQ(path(DType::bf16, d64), AttentionPath::cudnn);
    EXPECT_EQ(path(DType::f32, d64), AttentionPath::simple);
  }
  {
    ScopedAttentionChoice flash(AttentionChoice::flash);
    EXPECT_EQ(path(DType::bf16, d64), AttentionPath::flash);
    EXPECT_EQ(path(DType::bf16, d96), AttentionPath::simple);
  }
}

}  // namespace
}  // namespace octet
