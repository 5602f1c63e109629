// GEMM parity suite: every backend against an independent double-precision reference, for dense
// (f32, bf16) and FP8 operands under every scaling mode; beta = 1 accumulation over three calls;
// and the CPU against CUDA on identical FP8 inputs. The CPU contract's exact order, the operand
// factories and the argument checks are in gemm_contract_test.cc.
//
// Integer-valued inputs (small integers; FP8 block scales that are powers of two) make every
// product and partial sum exact in f32, so those cases demand bit-exact results. Random inputs
// are checked within the tolerances below.
#include "octet/ops/gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "octet/fp8/format.h"
#include "ops/gemm_check.h"
#include "test_util.h"

namespace octet::ops {
namespace {

using fp8::ScalingMode;
using octet::testing::fresh_seed;
using testing::kIntRange;
using testing::make_dense;
using testing::make_fp8;
using testing::TestOperand;
using testing::Values;

// ----------------------------------------------------------------------------
// Tolerances (relative L2 error against the double-precision reference)

/// f32's unit roundoff, 2^-24.
constexpr double kF32UnitRoundoff = 5.9604644775390625e-08;
/// f32 accumulation of K products. Each term is rounded up to 3 times before it is added (FP8:
/// value times scale_inv for A and for B, then the product), each of the K additions rounds by up
/// to u * |partial sum|, and the epilogue adds up to 2 roundings (+ beta * D_old, + bias). For
/// zero-mean random inputs the partial sums grow like sqrt(k), so the accumulation error relative
/// to the result is about u * sqrt(K / 6) (a random walk of roundings); when a few large FP8
/// products dominate a short sum, the per-term roundings dominate instead. We allow
/// u * (3 + 2 + sqrt(K)): K = 16: 5.4e-7; K = 333: 1.4e-6; K = 3221: 3.7e-6 (worst seen in 1800
/// random draws at K = 16: 0.43 of that).
constexpr double kTermRoundings = 3;
constexpr double kEpilogueRoundings = 2;
/// A bf16 D rounds to nearest with 8 significant bits: at most 2^-8 relative error per element,
/// so at most 2^-8 in relative L2, on top of the f32 error (added to it). A bound, not an estimate.
constexpr double kBf16OutputRelL2 = 0.00390625;
/// Tensor cores (CUDA bf16 and FP8 GEMMs) align the products of one MMA to the largest exponent
/// and truncate rather than round to nearest, so the f32 bound above does not describe them. They
/// are held to the CPU-vs-CUDA bound for FP8 with f32 output instead (from the CUDA backend's
/// brief).
constexpr double kTensorCoreRelL2 = 1e-5;
/// CUDA's fast FP8 accumulation (Hopper tensor cores keep about 14 significant bits of the sum
/// between promotions, DeepSeek-V3 report section 3.3.2): about 2^-14 per addition, random walk
/// over K <= 400 here; we allow 2^-9.
constexpr double kFastAccumulationRelL2 = 0.001953125;
/// Hopper's FP8 tensor cores with split accumulation: the products are exact, but the MMA adds
/// them to the running sum in reduced precision between promotions to FP32, so the f32 bound does
/// not apply. Measured on an H200 (2026-11-30, random inputs, K <= 1024): 2.2e-4; we allow 1e-3.
constexpr double kFp8TensorCoreRelL2 = 1e-3;
/// CPU vs CUDA on identical FP8 inputs with f32 output.
constexpr double kCpuCudaFp8RelL2 = kFp8TensorCoreRelL2;
/// Outputs whose reference costs more than this many multiply-adds are checked on sampled rows.
constexpr int64_t kFullCheckMacs = int64_t{1} << 26;
/// Reference multiply-adds budget for sampled rows, and the bounds on their count.
constexpr int64_t kSampledMacs = int64_t{1} << 28;
constexpr int64_t kMinSampledRows = 16;
constexpr int64_t kMaxSampledRows = 64;

// ----------------------------------------------------------------------------
// Cases

enum class Operands { f32, bf16, e4m3_e4m3, e4m3_e5m2, e5m2_e4m3 };
/// FP8 scaling of A x B; `none` for dense operands.
enum class Scaling { none, per_tensor, block_1x128_128x128, block_1x128_1x128, mxfp8 };
/// alpha, beta, bias and addend variants.
enum class Epilogue { plain, alpha, bias, full, addend, addend_bias };

struct Dims {
  int64_t m, n, k;
};

struct GemmCase {
  Device backend;
  Operands operands;
  Scaling scaling;
  DType out;
  Dims dims;
  bool transpose_a, transpose_b;
  Epilogue epilogue;
  Values values;
  Accumulation accumulation = Accumulation::split;
};

bool is_fp8_case(Operands o) { return o != Operands::f32 && o != Operands::bf16; }

std::array<DType, 2> operand_dtypes(Operands o) {
  switch (o) {
    case Operands::f32:
      return {DType::f32, DType::f32};
    case Operands::bf16:
      return {DType::bf16, DType::bf16};
    case Operands::e4m3_e4m3:
      return {DType::e4m3, DType::e4m3};
    case Operands::e4m3_e5m2:
      return {DType::e4m3, DType::e5m2};
    case Operands::e5m2_e4m3:
      return {DType::e5m2, DType::e4m3};
  }
  return {DType::f32, DType::f32};
}

std::array<ScalingMode, 2> scaling_modes(Scaling s) {
  switch (s) {
    case Scaling::none:
    case Scaling::per_tensor:
      return {ScalingMode::per_tensor, ScalingMode::per_tensor};
    case Scaling::block_1x128_128x128:
      return {ScalingMode::block_1x128, ScalingMode::block_128x128};
    case Scaling::block_1x128_1x128:
      return {ScalingMode::block_1x128, ScalingMode::block_1x128};
    case Scaling::mxfp8:
      return {ScalingMode::mxfp8_1x32, ScalingMode::mxfp8_1x32};
  }
  return {ScalingMode::per_tensor, ScalingMode::per_tensor};
}

struct EpilogueArgs {
  float alpha = 1.0f, beta = 0.0f;
  bool has_bias = false;
  DType bias_dtype = DType::f32;
  bool has_addend = false;  ///< GemmArgs::addend, in D's dtype
};

/// Powers of two keep integer cases exact; a negative alpha checks the sign path.
EpilogueArgs epilogue_args(Epilogue e) {
  switch (e) {
    case Epilogue::plain:
      return {};
    case Epilogue::alpha:
      return {-0.25f, 0.0f, false, DType::f32};
    case Epilogue::bias:
      return {1.0f, 0.0f, true, DType::f32};
    case Epilogue::full:
      return {0.5f, 2.0f, true, DType::bf16};
    case Epilogue::addend:
      return {1.0f, 0.0f, false, DType::f32, true};
    case Epilogue::addend_bias:
      return {-0.5f, 0.0f, true, DType::bf16, true};
  }
  return {};
}

std::string case_name(const GemmCase& c) {
  static constexpr const char* kOperands[] = {"f32", "bf16", "e4m3xe4m3", "e4m3xe5m2", "e5m2xe4m3"};
  static constexpr const char* kScaling[] = {"", "_pertensor", "_1x128x128x128", "_1x128x1x128",
                                             "_mxfp8"};
  static constexpr const char* kEpilogue[] = {"plain",         "alpha",  "bias",
                                              "alphabetabias", "addend", "alphabiasaddend"};
  std::ostringstream out;
  out << (c.backend.is_cpu() ? "cpu" : "cuda" + std::to_string(c.backend.index)) << "_"
      << kOperands[static_cast<int>(c.operands)] << kScaling[static_cast<int>(c.scaling)] << "_to"
      << dtype_name(c.out) << "_" << c.dims.m << "x" << c.dims.n << "x" << c.dims.k << "_"
      << (c.transpose_a ? "T" : "N") << (c.transpose_b ? "T" : "N") << "_"
      << kEpilogue[static_cast<int>(c.epilogue)] << "_"
      << (c.values == Values::integer ? "int" : "rand")
      << (c.accumulation == Accumulation::fast ? "_fastacc" : "");
  return out.str();
}

void PrintTo(const GemmCase& c, std::ostream* out) { *out << case_name(c); }

/// backend x operand types x scaling modes x out dtype x shapes x transposes x values; the
/// epilogue cycles through its variants so each one meets every dtype and shape family.
std::vector<GemmCase> parity_cases() {
  // (m, n, k): awkward row/column/inner extents for dense operands, multiples of 16 for FP8.
  const std::vector<Dims> dense_dims = {
      {1, 3221, 7}, {2333, 1, 19}, {7, 129, 3221}, {1481, 677, 333}};
  const std::vector<Dims> fp8_dims = {{16, 16, 16}, {128, 256, 384}, {272, 144, 400}};
  const Dims large = {16384, 8192, 8192};  // CUDA only, sampled rows
  const std::array<Epilogue, 6> epilogues = {Epilogue::plain,  Epilogue::alpha,
                                             Epilogue::bias,   Epilogue::full,
                                             Epilogue::addend, Epilogue::addend_bias};
  std::vector<GemmCase> cases;
  size_t cycle = 0;
  auto add = [&](GemmCase c) {
    // Shifted by one every round, so that no other axis stays in step with the rotation.
    c.epilogue = epilogues[(cycle + cycle / epilogues.size()) % epilogues.size()];
    ++cycle;
    cases.push_back(c);
  };
  for (const Device& backend : octet::testing::all_backends()) {
    for (Operands ops : {Operands::f32, Operands::bf16})
      for (DType out : {DType::f32, DType::bf16})
        for (const Dims& dims : dense_dims)
          for (int t = 0; t < 4; ++t)
            for (Values v : {Values::integer, Values::random})
              add({backend, ops, Scaling::none, out, dims, (t & 2) != 0, (t & 1) != 0,
                   Epilogue::plain, v});
    for (Operands ops : {Operands::e4m3_e4m3, Operands::e4m3_e5m2, Operands::e5m2_e4m3})
      for (Scaling s : {Scaling::per_tensor, Scaling::block_1x128_128x128,
                        Scaling::block_1x128_1x128, Scaling::mxfp8}) {
        for (DType out : {DType::f32, DType::bf16})
          for (const Dims& dims : fp8_dims) {
            for (Values v : {Values::integer, Values::random})
              add({backend, ops, s, out, dims, false, true, Epilogue::plain, v});
            // The CPU has one accumulation; tensor cores have two.
            if (backend.is_cuda())
              add({backend, ops, s, out, dims, false, true, Epilogue::plain, Values::random,
                   Accumulation::fast});
          }
        // One operand pair at the large shape: the sampled host reference costs seconds.
        if (backend.is_cuda() && !testing::small_tests_only() && ops == Operands::e4m3_e4m3)
          add({backend, ops, s, cycle % 2 ? DType::f32 : DType::bf16, large, false, true,
               Epilogue::plain, Values::integer});
      }
  }
  return cases;
}

// ----------------------------------------------------------------------------
// Inputs and the reference (the operands themselves come from ops/gemm_check.h)

/// D's initial contents: values to accumulate onto when beta != 0, otherwise NaN everywhere
/// (all bytes 0xFF), which proves D is not read when beta == 0.
Tensor make_initial_d(const Dims& dims, DType dtype, bool read, Values values, uint64_t seed) {
  if (read)
    return values == Values::integer
               ? octet::testing::random_int_tensor({dims.m, dims.n}, dtype, seed, kIntRange)
               : octet::testing::random_tensor({dims.m, dims.n}, dtype, seed);
  Tensor d = Tensor::empty({dims.m, dims.n}, dtype);
  std::memset(d.raw_data(), 0xFF, d.nbytes());
  return d;
}

/// Rows the check covers: all of them for small outputs, else the first and last 8 (edge tiles)
/// and random rows in between.
std::vector<int64_t> checked_rows(const Dims& dims, uint64_t seed) {
  std::vector<int64_t> rows;
  if (dims.m * dims.n * dims.k <= kFullCheckMacs) {
    for (int64_t r = 0; r < dims.m; ++r) rows.push_back(r);
    return rows;
  }
  const int64_t count =
      std::clamp(kSampledMacs / (dims.n * dims.k), kMinSampledRows, kMaxSampledRows);
  constexpr int64_t kEdgeRows = 8;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> middle(kEdgeRows, dims.m - kEdgeRows - 1);
  for (int64_t r = 0; r < kEdgeRows; ++r) rows.push_back(r);
  for (int64_t r = dims.m - kEdgeRows; r < dims.m; ++r) rows.push_back(r);
  while (static_cast<int64_t>(rows.size()) < count) rows.push_back(middle(rng));
  return rows;
}

/// The value a `dtype` D holds for the exact result v.
float stored_value(double v, DType dtype) {
  const auto f = static_cast<float>(v);
  return dtype == DType::bf16 ? fp8::decode_bf16(fp8::encode_bf16(f)) : f;
}

/// The reference, independent of the backends: op(A) x op(B) summed in double, then
/// alpha * sum + beta * D_old + bias in double; with an addend (the rows of `addend`),
/// stored(alpha * sum) + bias + addend, the product rounded to `out` first as docs/NUMERICS.md
/// specifies. Returns [rows.size(), n].
std::vector<double> reference(const TestOperand& a, const TestOperand& b, const Dims& dims,
                              const std::vector<int64_t>& rows, const EpilogueArgs& e,
                              const std::vector<float>& d_old, const std::vector<float>& bias,
                              const std::vector<float>& addend = {}, DType out = DType::f32) {
  const int64_t n = dims.n, k = dims.k, r = static_cast<int64_t>(rows.size());
  std::vector<double> a_rows(static_cast<size_t>(r * k));  // rows of op(A), [r, k]
  std::vector<double> bt(static_cast<size_t>(n * k));      // op(B)^T, [n, k]
  std::vector<double> result(static_cast<size_t>(r * n));
#pragma omp parallel
  {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < r; ++i)
      for (int64_t kk = 0; kk < k; ++kk) a_rows[i * k + kk] = a.op_value(false, rows[i], kk);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t kk = 0; kk < k; ++kk) bt[j * k + kk] = b.op_value(true, j, kk);
#pragma omp for schedule(static)
    for (int64_t ij = 0; ij < r * n; ++ij) {
      const int64_t i = ij / n, j = ij % n;
      double sum = 0;
      for (int64_t kk = 0; kk < k; ++kk) sum += a_rows[i * k + kk] * bt[j * k + kk];
      double v = double{e.alpha} * sum;
      if (e.has_addend) v = stored_value(v, out);
      if (e.beta != 0.0f) v += double{e.beta} * d_old[ij];
      if (e.has_bias) v += bias[j];
      if (e.has_addend) v += addend[ij];
      result[ij] = v;
    }
  }
  return result;
}

/// The rows of a [m, n] tensor (any device) as floats, concatenated.
std::vector<float> rows_of(const Tensor& t, const std::vector<int64_t>& rows) {
  if (static_cast<int64_t>(rows.size()) == t.size(0)) return octet::testing::to_floats(t);
  std::vector<float> out;
  for (int64_t r : rows) {
    const std::vector<float> row = octet::testing::to_floats(t.slice(r, r + 1));
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

/// ||actual - reference|| / ||reference||, in double.
double relative_l2(const std::vector<float>& actual, const std::vector<double>& reference) {
  double num = 0, den = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double diff = actual[i] - reference[i];
    num += diff * diff;
    den += reference[i] * reference[i];
  }
  return std::sqrt(num / den);
}

/// The BF16 values (as doubles) that rounding v to nearest may give: the nearest one, or both
/// neighbours when v lies exactly halfway and `either_tie`.
std::vector<double> bf16_roundings(double v, bool either_tie) {
  const auto f = static_cast<float>(v);          // every tie of an integer result fits in f32
  constexpr uint32_t kDropped = (1u << 16) - 1;  // the bits BF16 drops
  constexpr uint32_t kHalf = 1u << 15;
  const uint32_t bits = fp8::float_bits(f);
  if (!either_tie || static_cast<double>(f) != v || (bits & kDropped) != kHalf)
    return {stored_value(v, DType::bf16)};
  const uint32_t below = bits & ~kDropped;  // toward zero
  return {fp8::bits_float(below), fp8::bits_float(below + (1u << 16))};
}

/// True when the exact value v lies exactly halfway between two BF16 values and `actual` is one
/// of them (round-to-nearest with the tie broken either way).
bool is_bf16_tie_neighbour(float actual, double v) {
  const std::vector<double> roundings = bf16_roundings(v, /*either_tie=*/true);
  if (roundings.size() != 2) return false;
  const uint32_t a = fp8::float_bits(actual);
  return a == fp8::float_bits(static_cast<float>(roundings[0])) ||
         a == fp8::float_bits(static_cast<float>(roundings[1]));
}

/// The spacing of BF16 values at |x| (x != 0): 2^(exponent - 7).
double bf16_ulp(double x) { return std::ldexp(1.0, std::ilogb(x) - 7); }

/// How a GEMM's output is compared with the exact result of integer-valued inputs.
enum class Exactness {
  bits,                  ///< bit-exact
  zero_sign_free,        ///< bit-exact, but +0 and -0 are equal (the contract fixes the sign of an
                         ///< exact zero on the CPU only)
  bf16_ties_free,        ///< as zero_sign_free, and a BF16 value exactly halfway between two BF16
                         ///< neighbours may round to either: on the H200 (2026-11-30) cuBLASLt's
                         ///< BF16-output GEMMs round 0.1% to 4% of integer-valued results that way,
                         ///< i.e. not always to even (FP32 outputs are bit-exact)
  bf16_rounded_product,  ///< as bf16_ties_free, for epilogues that add a bias, beta * D or an
                         ///< addend: cuBLASLt's BF16 epilogues (H200, 2026-11-30) behave as if the
                         ///< product were rounded to BF16 before the addition, so the result may
                         ///< be off by half a BF16 ulp of the product plus one of the result. With
                         ///< an addend (H200, 2026-12-01) 0.02% to 8% of integer results are one
                         ///< BF16 ulp off the reference's rounding order, inside that bound
};

/// Compares `actual` with `exact` (double) rounded once to `out`. `product`: the exact alpha * A B
/// before the epilogue's additions (bf16_rounded_product only).
::testing::AssertionResult exactly_equal(const std::vector<float>& actual,
                                         const std::vector<double>& exact, DType out,
                                         Exactness exactness, const std::vector<int64_t>& rows,
                                         int64_t n, const std::vector<double>& product = {}) {
  int64_t mismatches = 0, ties = 0;
  size_t first = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const float expected = stored_value(exact[i], out);
    if (fp8::float_bits(actual[i]) == fp8::float_bits(expected)) continue;
    if (exactness != Exactness::bits && actual[i] == 0.0f && expected == 0.0f) continue;
    if (exactness == Exactness::bf16_ties_free && is_bf16_tie_neighbour(actual[i], exact[i])) {
      ++ties;
      continue;
    }
    if (exactness == Exactness::bf16_rounded_product) {
      const double p = product[i] == 0 ? 0 : bf16_ulp(product[i]) / 2;
      const double magnitude = std::max(std::fabs(exact[i]), std::fabs(double{actual[i]}));
      if (std::fabs(actual[i] - exact[i]) <= p + (magnitude == 0 ? 0 : bf16_ulp(magnitude))) {
        continue;
      }
    }
    if (mismatches++ == 0) first = i;
  }
  if (mismatches == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << mismatches << " of " << exact.size() << " elements differ (besides " << ties
         << " BF16 ties); first at D[" << rows[first / n] << ", " << first % n << "]: got "
         << actual[first] << ", expected " << stored_value(exact[first], out) << " (exact "
         << exact[first] << ")";
}

/// The comparison a backend is held to for integer-valued inputs; `epilogue_adds`: the GEMM adds
/// a bias or beta * D to the product; `addend`: it adds an addend (the reference then rounds the
/// product first, as the contract does).
Exactness integer_exactness(const Device& backend, DType out, bool epilogue_adds,
                            bool addend = false) {
  if (!backend.is_cuda()) return Exactness::bits;
  if (out != DType::bf16) return Exactness::zero_sign_free;
  return epilogue_adds || addend ? Exactness::bf16_rounded_product : Exactness::bf16_ties_free;
}

/// The relative L2 error allowed for random inputs (see the tolerance constants).
double random_tolerance(const GemmCase& c) {
  double tolerance = kF32UnitRoundoff * (kTermRoundings + kEpilogueRoundings +
                                         std::sqrt(static_cast<double>(c.dims.k)));
  if (c.backend.is_cuda() && c.operands != Operands::f32)
    tolerance = c.accumulation == Accumulation::fast ? kFastAccumulationRelL2
                : c.operands == Operands::bf16       ? kTensorCoreRelL2
                                                     : kFp8TensorCoreRelL2;
  if (c.out == DType::bf16) tolerance += kBf16OutputRelL2;
  // With an addend the product is rounded to BF16 as well, in the reference and the backend
  // alike; when the backend's sum and the exact one straddle a rounding boundary that rounding
  // lands on the other side, which costs at most one more BF16 rounding of the product.
  if (c.out == DType::bf16 && epilogue_args(c.epilogue).has_addend) tolerance += kBf16OutputRelL2;
  return tolerance;
}

// ----------------------------------------------------------------------------
// The parity suite

class GemmParity : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmParity, MatchesReference) {
  const GemmCase& c = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(c.backend);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const auto [a_dtype, b_dtype] = operand_dtypes(c.operands);
  const Dims& dims = c.dims;

  TestOperand a, b;
  if (is_fp8_case(c.operands)) {
    const auto [a_mode, b_mode] = scaling_modes(c.scaling);
    a = make_fp8(dims.m, dims.k, a_dtype, a_mode, c.transpose_a, c.values, seed + 1);
    b = make_fp8(dims.n, dims.k, b_dtype, b_mode, c.transpose_b, c.values, seed + 2);
  } else {
    const Shape a_shape = c.transpose_a ? Shape{dims.k, dims.m} : Shape{dims.m, dims.k};
    const Shape b_shape = c.transpose_b ? Shape{dims.n, dims.k} : Shape{dims.k, dims.n};
    a = make_dense(a_shape, a_dtype, c.transpose_a, c.values, seed + 1);
    b = make_dense(b_shape, b_dtype, c.transpose_b, c.values, seed + 2);
  }
  const EpilogueArgs e = epilogue_args(c.epilogue);
  const Tensor d_host = make_initial_d(dims, c.out, e.beta != 0.0f, c.values, seed + 3);
  Tensor bias_host;
  std::vector<float> bias;
  if (e.has_bias) {
    bias_host = c.values == Values::integer
                    ? octet::testing::random_int_tensor({dims.n}, e.bias_dtype, seed + 4)
                    : octet::testing::random_tensor({dims.n}, e.bias_dtype, seed + 4);
    bias = octet::testing::to_floats(bias_host);
  }
  // An addend in D's dtype; D itself then starts as NaN (beta is 0), so reading it would show.
  Tensor addend_host;
  if (e.has_addend) {
    addend_host = c.values == Values::integer
                      ? octet::testing::random_int_tensor({dims.m, dims.n}, c.out, seed + 6)
                      : octet::testing::random_tensor({dims.m, dims.n}, c.out, seed + 6);
  }

  GemmArgs args;
  args.alpha = e.alpha;
  args.beta = e.beta;
  args.accumulation = c.accumulation;
  if (e.has_bias) args.bias = bias_host.to(c.backend);
  if (e.has_addend) args.addend = addend_host.to(c.backend);
  const Tensor d = d_host.to(c.backend);
  gemm(a.on(c.backend), b.on(c.backend), d, args);
  if (e.has_addend) {
    EXPECT_TRUE(octet::testing::bitwise_equal(addend_host, args.addend)) << "the addend changed";
  }

  const std::vector<int64_t> rows = checked_rows(dims, seed + 5);
  const std::vector<float> actual = rows_of(d, rows);
  const std::vector<double> ref =
      reference(a, b, dims, rows, e, e.beta != 0.0f ? rows_of(d_host, rows) : std::vector<float>{},
                bias, e.has_addend ? rows_of(addend_host, rows) : std::vector<float>{}, c.out);
  for (float v : actual) ASSERT_FALSE(std::isnan(v)) << "D holds NaN";

  if (c.values == Values::integer) {
    const bool adds = e.has_bias || e.beta != 0.0f || e.has_addend;
    const std::vector<double> product =
        adds ? reference(a, b, dims, rows, EpilogueArgs{.alpha = e.alpha}, {}, {})
             : std::vector<double>{};
    EXPECT_TRUE(exactly_equal(actual, ref, c.out,
                              integer_exactness(c.backend, c.out, adds, e.has_addend), rows, dims.n,
                              product));
    return;
  }
  EXPECT_LE(relative_l2(actual, ref), random_tolerance(c));
}

INSTANTIATE_TEST_SUITE_P(AllBackends, GemmParity, ::testing::ValuesIn(parity_cases()),
                         [](const auto& info) { return case_name(info.param); });

// ----------------------------------------------------------------------------
// beta = 1 accumulates: three calls into one D (gradient accumulation)

struct AccumulateCase {
  Device backend;
  Operands operands;
  Scaling scaling;
  DType out;
};

std::string accumulate_name(const AccumulateCase& c) {
  GemmCase g{c.backend, c.operands, c.scaling,       c.out,          {48, 80, 64},
             false,     true,       Epilogue::plain, Values::integer};
  const std::string name = case_name(g);
  return name.substr(0, name.find("_48x80x64"));
}

void PrintTo(const AccumulateCase& c, std::ostream* out) { *out << accumulate_name(c); }

class GemmAccumulate : public ::testing::TestWithParam<AccumulateCase> {};

TEST_P(GemmAccumulate, BetaOneSumsThreeCalls) {
  const AccumulateCase& c = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(c.backend);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  constexpr int kCalls = 3;
  const Dims dims{48, 80, 64};  // multiples of 16 for FP8, several micro-tiles for the CPU
  const auto [a_dtype, b_dtype] = operand_dtypes(c.operands);
  const auto [a_mode, b_mode] = scaling_modes(c.scaling);
  const std::vector<int64_t> rows = checked_rows(dims, seed);

  const Tensor d = Tensor::zeros({dims.m, dims.n}, c.out, c.backend);
  std::vector<float> d_old(rows.size() * static_cast<size_t>(dims.n), 0.0f);
  EpilogueArgs e;
  e.beta = 1.0f;
  for (int call = 0; call < kCalls; ++call) {
    SCOPED_TRACE(::testing::Message() << "call " << call);
    const uint64_t s = seed + 10 * call;
    TestOperand a, b;
    if (is_fp8_case(c.operands)) {
      a = make_fp8(dims.m, dims.k, a_dtype, a_mode, false, Values::integer, s + 1);
      b = make_fp8(dims.n, dims.k, b_dtype, b_mode, true, Values::integer, s + 2);
    } else {
      a = make_dense({dims.m, dims.k}, a_dtype, false, Values::integer, s + 1);
      b = make_dense({dims.k, dims.n}, b_dtype, false, Values::integer, s + 2);
    }
    GemmArgs args;
    args.beta = 1.0f;
    gemm(a.on(c.backend), b.on(c.backend), d, args);
    // Each call reads the D the previous one stored (rounded to D's dtype).
    const std::vector<double> ref = reference(a, b, dims, rows, e, d_old, {});
    const std::vector<double> product = reference(a, b, dims, rows, EpilogueArgs{}, {}, {});
    d_old = rows_of(d, rows);
    ASSERT_TRUE(exactly_equal(d_old, ref, c.out,
                              integer_exactness(c.backend, c.out, /*epilogue_adds=*/true), rows,
                              dims.n, product));
  }
}

std::vector<AccumulateCase> accumulate_cases() {
  std::vector<AccumulateCase> cases;
  for (const Device& backend : octet::testing::all_backends())
    for (DType out : {DType::f32, DType::bf16}) {
      cases.push_back({backend, Operands::f32, Scaling::none, out});
      cases.push_back({backend, Operands::bf16, Scaling::none, out});
      cases.push_back({backend, Operands::e4m3_e4m3, Scaling::per_tensor, out});
      cases.push_back({backend, Operands::e5m2_e4m3, Scaling::block_1x128_128x128, out});
      cases.push_back({backend, Operands::e4m3_e5m2, Scaling::mxfp8, out});
    }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllBackends, GemmAccumulate, ::testing::ValuesIn(accumulate_cases()),
                         [](const auto& info) { return accumulate_name(info.param); });

// ----------------------------------------------------------------------------
// CPU vs CUDA on identical FP8 inputs

struct CrossCase {
  Operands operands;
  Scaling scaling;
};

std::string cross_name(const CrossCase& c) {
  GemmCase g{Device::cpu(), c.operands, c.scaling,       DType::f32,    {1, 1, 1},
             false,         true,       Epilogue::plain, Values::random};
  const std::string name = case_name(g);
  return name.substr(4, name.find("_tof32") - 4);
}

void PrintTo(const CrossCase& c, std::ostream* out) { *out << cross_name(c); }

class GemmCpuVsCuda : public ::testing::TestWithParam<CrossCase> {};

TEST_P(GemmCpuVsCuda, Fp8AgreesWithinTolerance) {
  const CrossCase& c = GetParam();
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Dims dims{256, 384, 1024};  // several 128-blocks along every dimension
  const auto [a_dtype, b_dtype] = operand_dtypes(c.operands);
  const auto [a_mode, b_mode] = scaling_modes(c.scaling);
  const TestOperand a = make_fp8(dims.m, dims.k, a_dtype, a_mode, false, Values::random, seed);
  const TestOperand b = make_fp8(dims.n, dims.k, b_dtype, b_mode, true, Values::random, seed + 1);
  const Tensor d_cpu = Tensor::empty({dims.m, dims.n}, DType::f32);
  const Tensor d_gpu = Tensor::empty({dims.m, dims.n}, DType::f32, gpu);
  gemm(a.op, b.op, d_cpu);
  gemm(a.on(gpu), b.on(gpu), d_gpu);
  EXPECT_LE(octet::testing::relative_l2(octet::testing::to_floats(d_gpu),
                                        octet::testing::to_floats(d_cpu)),
            kCpuCudaFp8RelL2);
}

std::vector<CrossCase> cross_cases() {
  std::vector<CrossCase> cases;
  for (Operands ops : {Operands::e4m3_e4m3, Operands::e4m3_e5m2, Operands::e5m2_e4m3})
    for (Scaling s : {Scaling::per_tensor, Scaling::block_1x128_128x128, Scaling::block_1x128_1x128,
                      Scaling::mxfp8})
      cases.push_back({ops, s});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fp8, GemmCpuVsCuda, ::testing::ValuesIn(cross_cases()),
                         [](const auto& info) { return cross_name(info.param); });
}  // namespace
}  // namespace octet::ops
