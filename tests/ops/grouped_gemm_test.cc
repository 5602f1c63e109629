// Grouped GEMM suite: on every backend each group's result is bitwise what ops::gemm gives for that
// group alone (forward/dgrad and wgrad, every FP8 scaling mode and BF16, balanced, skewed and
// single-group splits with empty groups), the CUDA backend matches the CPU within the dense GEMM
// suite's CPU-vs-CUDA tolerance, and bad arguments get messages naming the group.
#include "octet/ops/grouped_gemm.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "octet/fp8/quantized_tensor.h"
#include "octet/ops/quantize.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet::ops {
namespace {

using fp8::ScalingMode;
using octet::testing::bitwise_equal;
using octet::testing::fresh_seed;
using octet::testing::random_tensor;
using testing::expect_error;

/// Every group's rows come in multiples of the FP8 GEMM alignment, as the MoE dispatch pads them.
constexpr int64_t kRowUnit = 16;
constexpr int64_t kGroups = 16;
/// K and N of the suite: two 128-wide blocks, so block scales index more than one block.
constexpr int64_t kInner = 256;
constexpr int64_t kOuter = 96;
/// CPU vs CUDA, relative L2: FP8 with f32 output, the dense GEMM suite's bound (an H200's FP8
/// split accumulation: 2.2e-4 measured, 1e-3 allowed); BF16 output adds one bf16 rounding, 2^-8.
constexpr double kCpuCudaFp8RelL2 = 1e-3;
constexpr double kCpuCudaBf16RelL2 = 1e-3 + 1.0 / 256;

enum class Mode { bf16, per_tensor, block_1x128x128x128, block_1x128x1x128, mxfp8 };
enum class Split { balanced, skewed, one_group };

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::bf16:
      return "bf16";
    case Mode::per_tensor:
      return "pertensor";
    case Mode::block_1x128x128x128:
      return "block1x128x128x128";
    case Mode::block_1x128x1x128:
      return "block1x128x1x128";
    case Mode::mxfp8:
      return "mxfp8";
  }
  return "?";
}

/// Row units per group: balanced; half the rows on 2 of 16 groups (with 2 empty groups); every
/// row in one group.
std::vector<int64_t> offsets_for(Split split) {
  std::vector<int64_t> units(kGroups, 2);
  if (split == Split::skewed) {
    units = {2, 3, 1, 14, 0, 2, 2, 4, 1, 14, 2, 3, 0, 2, 4, 2};
  } else if (split == Split::one_group) {
    units.assign(kGroups, 0);
    units[5] = 24;
  }
  std::vector<int64_t> offsets{0};
  for (int64_t u : units) offsets.push_back(offsets.back() + u * kRowUnit);
  return offsets;
}

bool is_fp8_mode(Mode m) { return m != Mode::bf16; }

/// (activation mode, weight mode) of an FP8 case.
std::pair<ScalingMode, ScalingMode> scaling_of(Mode m) {
  switch (m) {
    case Mode::block_1x128x128x128:
      return {ScalingMode::block_1x128, ScalingMode::block_128x128};
    case Mode::block_1x128x1x128:
      return {ScalingMode::block_1x128, ScalingMode::block_1x128};
    case Mode::mxfp8:
      return {ScalingMode::mxfp8_1x32, ScalingMode::mxfp8_1x32};
    default:
      return {ScalingMode::per_tensor, ScalingMode::per_tensor};
  }
}

/// x quantized (both copies) in `mode`; per-tensor with a scale that differs per call, so that a
/// group using another group's scale would show.
fp8::QuantizedTensor quantize_as(const Tensor& x, DType dtype, ScalingMode mode, float scale) {
  fp8::QuantizedTensor q = fp8::QuantizedTensor::allocate(
      x.rows(), x.cols(), dtype, mode, fp8::Usage{.rowwise = true, .columnwise = true}, x.device());
  QuantizeArgs args;
  if (mode == ScalingMode::per_tensor)
    args.scale = Tensor::from_vector(std::vector<float>{scale}, {1}).to(x.device());
  quantize(x, q, args);
  return q;
}

struct Case {
  Device backend;
  Mode mode;
  Split split;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  const char* split = c.split == Split::balanced ? "balanced"
                      : c.split == Split::skewed ? "skewed"
                                                 : "onegroup";
  return octet::testing::device_name(c.backend) + "_" + mode_name(c.mode) + "_" + split;
}

/// Inputs of one case on `device`: X [T, K] and dY [T, N] expert-contiguous, a weight per group,
/// and per group the FP8 copies its GEMMs read (each group quantized on its own, as per-expert FP8
/// states do).
struct Inputs {
  std::vector<int64_t> offsets;
  Tensor x, dy;
  std::vector<Tensor> w;
  std::vector<GemmOperand> fwd_a, fwd_b, wgrad_a, wgrad_b;
};

Inputs make_inputs(const Case& c, uint64_t seed, const Device& device) {
  Inputs in;
  in.offsets = offsets_for(c.split);
  const int64_t rows = in.offsets.back();
  const DType hp = DType::bf16;
  in.x = random_tensor({rows, kInner}, hp, seed).to(device);
  in.dy = random_tensor({rows, kOuter}, hp, seed + 1).to(device);
  const auto [act_mode, w_mode] = scaling_of(c.mode);
  for (int64_t g = 0; g < kGroups; ++g) {
    in.w.push_back(random_tensor({kOuter, kInner}, hp, seed + 2 + g).to(device));
    const Tensor xg = in.x.slice(in.offsets[g], in.offsets[g + 1]);
    const Tensor dyg = in.dy.slice(in.offsets[g], in.offsets[g + 1]);
    const bool empty = xg.rows() == 0;
    if (!is_fp8_mode(c.mode)) {
      in.fwd_a.push_back(GemmOperand::dense(xg));
      in.fwd_b.push_back(GemmOperand::dense(in.w[g], /*transpose=*/true));
      in.wgrad_a.push_back(GemmOperand::dense(dyg, /*transpose=*/true));
      in.wgrad_b.push_back(GemmOperand::dense(xg));
      continue;
    }
    const float scale = 1.0f + 0.25f * static_cast<float>(g);
    const auto wq = quantize_as(in.w[g], DType::e4m3, w_mode, scale);
    in.fwd_b.push_back(GemmOperand::fp8(wq, false, /*transpose=*/true));
    if (empty) {  // nothing to quantize: an operand without rows
      in.fwd_a.emplace_back();
      in.wgrad_a.emplace_back();
      in.wgrad_b.emplace_back();
      continue;
    }
    const auto xq = quantize_as(xg, DType::e4m3, act_mode, scale);
    const auto dyq = quantize_as(dyg, DType::e5m2, act_mode, 2.0f * scale);
    in.fwd_a.push_back(GemmOperand::fp8(xq, false));
    // dW_g [N, K] = dY_g^T X_g: both transposed copies, K-contiguous (TN).
    in.wgrad_a.push_back(GemmOperand::fp8(dyq, true));
    in.wgrad_b.push_back(GemmOperand::fp8(xq, true, /*transpose=*/true));
  }
  return in;
}

GroupedGemmArgs forward_args(const Case& c, const std::vector<Tensor>& bias) {
  GroupedGemmArgs args;
  args.bias = bias;
  args.accumulation = is_fp8_mode(c.mode) ? Accumulation::fast : Accumulation::split;
  return args;
}

/// Per-group biases, or none for the MXFP8 case (its emulated GEMM takes the bias like the
/// others; one case without covers the no-bias path).
std::vector<Tensor> make_bias(const Case& c, uint64_t seed, const Device& device) {
  std::vector<Tensor> bias;
  if (c.mode == Mode::mxfp8) return bias;
  for (int64_t g = 0; g < kGroups; ++g)
    bias.push_back(random_tensor({kOuter}, DType::f32, seed + 100 + g).to(device));
  return bias;
}

struct Outputs {
  Tensor y;                // [T, N] forward
  std::vector<Tensor> dw;  // [N, K] per group, accumulated onto a start value
};

/// Forward (f32 output for FP8, bf16 for BF16) and wgrad with beta = 1 onto `dw_start` (group 4's
/// with beta = 0 separately is covered by WgradBetaZeroClearsEmptyGroups).
Outputs run_grouped(const Case& c, const Inputs& in, const std::vector<Tensor>& bias,
                    const std::vector<Tensor>& dw_start) {
  Outputs out;
  const DType y_dtype = is_fp8_mode(c.mode) ? DType::f32 : DType::bf16;
  out.y = Tensor::zeros({in.offsets.back(), kOuter}, y_dtype, in.x.device());
  grouped_gemm(in.fwd_a, in.fwd_b, out.y, in.offsets, forward_args(c, bias));
  for (const Tensor& d : dw_start) out.dw.push_back(d.clone());
  GroupedGemmArgs wgrad;
  wgrad.beta = 1.0f;
  grouped_gemm_wgrad(in.wgrad_a, in.wgrad_b, out.dw, in.offsets, wgrad);
  return out;
}

/// The same through ops::gemm, one group at a time.
Outputs run_per_group(const Case& c, const Inputs& in, const std::vector<Tensor>& bias,
                      const std::vector<Tensor>& dw_start) {
  Outputs out;
  const DType y_dtype = is_fp8_mode(c.mode) ? DType::f32 : DType::bf16;
  out.y = Tensor::zeros({in.offsets.back(), kOuter}, y_dtype, in.x.device());
  for (int64_t g = 0; g < kGroups; ++g) {
    out.dw.push_back(dw_start[g].clone());
    if (in.offsets[g + 1] == in.offsets[g]) continue;
    GemmArgs args;
    if (!bias.empty()) args.bias = bias[g];
    args.accumulation = forward_args(c, bias).accumulation;
    gemm(in.fwd_a[g], in.fwd_b[g], out.y.slice(in.offsets[g], in.offsets[g + 1]), args);
    GemmArgs wgrad;
    wgrad.beta = 1.0f;
    gemm(in.wgrad_a[g], in.wgrad_b[g], out.dw[g], wgrad);
  }
  return out;
}

std::vector<Tensor> dw_start_values(uint64_t seed, const Device& device) {
  std::vector<Tensor> dw;
  for (int64_t g = 0; g < kGroups; ++g)
    dw.push_back(random_tensor({kOuter, kInner}, DType::f32, seed + 200 + g).to(device));
  return dw;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const Device& backend : octet::testing::all_backends())
    for (Mode m : {Mode::bf16, Mode::per_tensor, Mode::block_1x128x128x128,
                   Mode::block_1x128x1x128, Mode::mxfp8})
      for (Split s : {Split::balanced, Split::skewed, Split::one_group})
        cases.push_back({backend, m, s});
  return cases;
}

class GroupedGemm : public ::testing::TestWithParam<Case> {};

TEST_P(GroupedGemm, EachGroupIsBitwiseTheDenseGemm) {
  const Case& c = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(c.backend);
  const uint64_t seed = fresh_seed();
  const Inputs in = make_inputs(c, seed, c.backend);
  const std::vector<Tensor> bias = make_bias(c, seed, c.backend);
  const std::vector<Tensor> dw0 = dw_start_values(seed, c.backend);
  const Outputs grouped = run_grouped(c, in, bias, dw0);
  const Outputs dense = run_per_group(c, in, bias, dw0);
  EXPECT_TRUE(bitwise_equal(dense.y, grouped.y)) << "forward";
  for (int64_t g = 0; g < kGroups; ++g) {
    EXPECT_TRUE(bitwise_equal(dense.dw[g], grouped.dw[g])) << "wgrad of group " << g;
    if (in.offsets[g + 1] == in.offsets[g])  // an empty group's gradient is left as it was
      EXPECT_TRUE(bitwise_equal(dw0[g], grouped.dw[g])) << "empty group " << g;
  }
  // Not all zero: the comparison above compared something.
  const std::vector<float> y = octet::testing::to_floats(grouped.y);
  EXPECT_GT(std::count_if(y.begin(), y.end(), [](float v) { return v != 0.0f; }), 0);
}

TEST_P(GroupedGemm, CudaMatchesCpu) {
  const Case& c = GetParam();
  if (c.backend.is_cpu()) GTEST_SKIP() << "the CUDA case compares against the CPU";
  OCTET_SKIP_IF_UNAVAILABLE(c.backend);
  std::printf("grouped GEMM path on %s: %s\n", octet::testing::device_name(c.backend).c_str(),
              grouped_gemm_path(c.backend).c_str());
  const uint64_t seed = fresh_seed();
  const Device cpu = Device::cpu();
  const Inputs gpu_in = make_inputs(c, seed, c.backend);
  const Inputs cpu_in = make_inputs(c, seed, cpu);
  const Outputs gpu = run_grouped(c, gpu_in, make_bias(c, seed, c.backend),
                                  dw_start_values(seed, c.backend));
  const Outputs ref = run_grouped(c, cpu_in, make_bias(c, seed, cpu), dw_start_values(seed, cpu));
  const double tol = is_fp8_mode(c.mode) ? kCpuCudaFp8RelL2 : kCpuCudaBf16RelL2;
  EXPECT_LE(octet::testing::relative_l2(octet::testing::to_floats(gpu.y),
                                        octet::testing::to_floats(ref.y)),
            tol);
  for (int64_t g = 0; g < kGroups; ++g) {
    EXPECT_LE(octet::testing::relative_l2(octet::testing::to_floats(gpu.dw[g]),
                                          octet::testing::to_floats(ref.dw[g])),
              kCpuCudaFp8RelL2)
        << "wgrad of group " << g;
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, GroupedGemm, ::testing::ValuesIn(all_cases()), case_name);

class GroupedGemmBackend : public ::testing::TestWithParam<Device> {};

TEST_P(GroupedGemmBackend, WgradBetaZeroClearsEmptyGroups) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  const Case c{device, Mode::bf16, Split::skewed};
  const Inputs in = make_inputs(c, seed, device);
  std::vector<Tensor> dw = dw_start_values(seed, device);
  grouped_gemm_wgrad(in.wgrad_a, in.wgrad_b, dw, in.offsets, {});
  for (int64_t g = 0; g < kGroups; ++g) {
    Tensor expected = Tensor::zeros({kOuter, kInner}, DType::f32, device);
    if (in.offsets[g + 1] != in.offsets[g]) gemm(in.wgrad_a[g], in.wgrad_b[g], expected);
    EXPECT_TRUE(bitwise_equal(expected, dw[g])) << "group " << g;
  }
}

TEST_P(GroupedGemmBackend, OneBufferSplitByOffsetsEqualsPerGroupOperands) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  const Case c{device, Mode::block_1x128x1x128, Split::skewed};
  const Inputs in = make_inputs(c, seed, device);
  // One 1x128 quantization of the whole buffer: its row ranges are the groups' operands.
  const auto xq = quantize_as(in.x, DType::e4m3, ScalingMode::block_1x128, 1.0f);
  const GemmOperand whole = GemmOperand::fp8(xq, false);
  const std::vector<GemmOperand> parts = split_rows(whole, in.offsets);
  Tensor y_whole = Tensor::zeros({in.offsets.back(), kOuter}, DType::f32, device);
  Tensor y_parts = Tensor::zeros({in.offsets.back(), kOuter}, DType::f32, device);
  grouped_gemm(std::span(&whole, 1), in.fwd_b, y_whole, in.offsets);
  grouped_gemm(parts, in.fwd_b, y_parts, in.offsets);
  EXPECT_TRUE(bitwise_equal(y_parts, y_whole));
}

TEST_P(GroupedGemmBackend, RefusesBadArguments) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  const Case c{device, Mode::per_tensor, Split::balanced};
  const Inputs in = make_inputs(c, seed, device);
  Tensor y = Tensor::zeros({in.offsets.back(), kOuter}, DType::f32, device);
  std::vector<int64_t> short_offsets(in.offsets.begin(), in.offsets.end() - 1);
  expect_error([&] { grouped_gemm(in.fwd_a, in.fwd_b, y, short_offsets); },
               {"expected 17 group offsets", "got 16"});
  std::vector<int64_t> decreasing = in.offsets;
  std::swap(decreasing[3], decreasing[4]);
  expect_error([&] { grouped_gemm(in.fwd_a, in.fwd_b, y, decreasing); }, {"must not decrease"});
  // Group 7's weight with another K: the dense check's message, naming the group.
  std::vector<GemmOperand> b = in.fwd_b;
  const auto wq = quantize_as(random_tensor({kOuter, kInner / 2}, DType::bf16, seed).to(device),
                              DType::e4m3, ScalingMode::per_tensor, 1.0f);
  b[7] = GemmOperand::fp8(wq, false, true);
  expect_error([&] { grouped_gemm(in.fwd_a, b, y, in.offsets); },
               {"group 7", "inner dimensions differ"});
  const auto w128 = quantize_as(in.x, DType::e4m3, ScalingMode::block_128x128, 1.0f);
  expect_error([&] { split_rows(GemmOperand::fp8(w128, false), in.offsets); },
               {"128x128", "cannot be split"});
}

// The groups may run in any order or at once (the CUDA backend spreads them over streams), so
// groups that depend on each other are refused rather than raced.
TEST_P(GroupedGemmBackend, RefusesGroupsThatAreNotIndependent) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  const Case c{device, Mode::bf16, Split::balanced};
  const Inputs in = make_inputs(c, seed, device);
  std::vector<Tensor> dw = dw_start_values(seed, device);
  dw[5] = dw[2];  // two groups accumulate into one tensor
  expect_error([&] { grouped_gemm_wgrad(in.wgrad_a, in.wgrad_b, dw, in.offsets, {}); },
               {"grouped_gemm: groups", "write overlapping memory"});
  // Group 1 multiplies what group 0 writes.
  const Tensor a0 = random_tensor({16, 32}, DType::bf16, seed).to(device);
  const Tensor b0 = random_tensor({24, 32}, DType::bf16, seed + 1).to(device);
  const Tensor b1 = random_tensor({8, 24}, DType::bf16, seed + 2).to(device);
  const Tensor d0 = Tensor::empty({16, 24}, DType::bf16, device);
  const Tensor d1 = Tensor::empty({16, 8}, DType::bf16, device);
  const GemmProblem chained[] = {
      {GemmOperand::dense(a0), GemmOperand::dense(b0, true), d0, {}},
      {GemmOperand::dense(d0), GemmOperand::dense(b1, true), d1, {}}};
  expect_error([&] { grouped_gemm(chained); }, {"group 0 writes memory that group 1 reads"});
}

INSTANTIATE_TEST_SUITE_P(AllBackends, GroupedGemmBackend,
                         ::testing::ValuesIn(octet::testing::all_backends()),
                         [](const auto& info) { return octet::testing::device_name(info.param); });

}  // namespace
}  // namespace octet::ops
