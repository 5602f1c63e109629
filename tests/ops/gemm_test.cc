// GEMM parity suite: every backend against an independent double-precision reference, for dense
// (f32, bf16) and FP8 operands under every scaling mode, plus the argument checks.
//
// Integer-valued inputs (small integers; FP8 block scales that are powers of two) make every
// product and partial sum exact in f32, so those cases demand bit-exact results. Random inputs
// are checked within the tolerances below.
#include "octet/ops/gemm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "octet/fp8/format.h"
#include "octet/ops/activation.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet::ops {
namespace {

using fp8::ScalingMode;
using octet::testing::fresh_seed;
using testing::expect_error;

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

/// Integer inputs are drawn from [-kIntRange, kIntRange]: exact in bf16, e4m3 and e5m2.
constexpr int kIntRange = 4;
/// Integer-valued FP8 cases draw each block's scale_inv from 2^[-kIntScaleExp, kIntScaleExp], so
/// a wrong scale index changes the result while every product stays exact. The largest sum,
/// 4 * 4 * 2 * 2 * K with K = 8192 in steps of 1/4, needs 21 bits (< f32's 24).
constexpr int kIntScaleExp = 1;
/// Random FP8 cases draw scale_inv log-uniformly from 2^[-kRandomScaleExp, kRandomScaleExp].
constexpr int kRandomScaleExp = 4;
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
enum class Values { integer, random };

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
// Inputs and the reference

/// SplitMix64: a fast generator for the large FP8 fills.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

/// Index of the scale that covers stored element (r, c), per the ScalingMode definitions.
int64_t scale_index(ScalingMode mode, int64_t r, int64_t c, int64_t scale_cols) {
  switch (mode) {
    case ScalingMode::per_tensor:
      return 0;
    case ScalingMode::block_1x128:
      return r * scale_cols + c / fp8::kBlock;
    case ScalingMode::block_128x128:
      return (r / fp8::kBlock) * scale_cols + c / fp8::kBlock;
    case ScalingMode::mxfp8_1x32:
      return r * scale_cols + c / fp8::kMxBlock;
  }
  return 0;
}

/// A GEMM operand on the CPU together with its exact values, for the reference.
struct TestOperand {
  GemmOperand op;
  std::vector<float> dense;     ///< dense: the stored values
  std::array<double, 256> lut;  ///< FP8: decoded bytes
  std::vector<double> scales;   ///< FP8: decoded scale_inv

  /// Stored element (r, c) as a double (FP8: decoded value times its scale, exactly).
  double value(int64_t r, int64_t c) const {
    const int64_t cols = op.data.cols();
    if (!is_fp8(op.data.dtype())) return dense[r * cols + c];
    const auto* bytes = static_cast<const uint8_t*>(op.data.raw_data());
    return lut[bytes[r * cols + c]] * scales[scale_index(op.mode, r, c, op.scale_inv.cols())];
  }
  /// Element (i, k) of op(X) when X plays A (outer = m), or (k, i) of op(X) for B (outer = n).
  double op_value(bool is_b, int64_t outer, int64_t k) const {
    const bool k_contiguous = is_b ? op.transpose : !op.transpose;
    return k_contiguous ? value(outer, k) : value(k, outer);
  }
  GemmOperand on(const Device& device) const {
    GemmOperand x = op;
    x.data = op.data.to(device);
    if (op.scale_inv.defined()) x.scale_inv = op.scale_inv.to(device);
    return x;
  }
};

TestOperand make_dense(const Shape& stored, DType dtype, bool transpose, Values values,
                       uint64_t seed) {
  const Tensor t = values == Values::integer
                       ? octet::testing::random_int_tensor(stored, dtype, seed, kIntRange)
                       : octet::testing::random_tensor(stored, dtype, seed);
  TestOperand x;
  x.op = GemmOperand::dense(t, transpose);
  x.dense = octet::testing::to_floats(t);
  return x;
}

/// An FP8 [rows, cols] operand, written byte by byte (independent of the quantize op).
/// Integer values: integers in [-kIntRange, kIntRange] with power-of-two scales. Random values:
/// any finite FP8 byte (subnormals and -0 included) with log-uniform scales.
TestOperand make_fp8(int64_t rows, int64_t cols, DType dtype, ScalingMode mode, bool transpose,
                     Values values, uint64_t seed) {
  fp8::QuantizedTensor q =
      fp8::QuantizedTensor::allocate(rows, cols, dtype, mode, fp8::Usage{}, Device::cpu());
  auto* bytes = static_cast<uint8_t*>(q.data.raw_data());
  const int64_t count = q.data.numel();
  SplitMix64 rng{seed};
  TestOperand x;
  for (int v = 0; v < 256; ++v) x.lut[v] = fp8::decode_fp8(static_cast<uint8_t>(v), dtype);
  std::array<uint8_t, 2 * kIntRange + 1> int_bytes;
  for (int v = -kIntRange; v <= kIntRange; ++v)
    int_bytes[v + kIntRange] = fp8::encode_fp8(static_cast<float>(v), dtype);
  bool any_nonzero = false;
  for (int64_t i = 0; i < count; i += 8) {
    uint64_t bits = rng.next();
    for (int64_t j = i; j < std::min(i + 8, count); ++j, bits >>= 8) {
      uint8_t byte;
      if (values == Values::integer) {
        byte = int_bytes[(bits & 0xFF) % int_bytes.size()];
      } else {
        byte = static_cast<uint8_t>(bits & 0xFF);
        while (!std::isfinite(x.lut[byte])) byte = static_cast<uint8_t>(rng.next());
      }
      any_nonzero |= x.lut[byte] != 0.0;
      bytes[j] = byte;
    }
  }
  if (!any_nonzero) bytes[0] = fp8::encode_fp8(1.0f, dtype);

  std::mt19937_64 scale_rng(seed ^ 0x5CA1Eull);
  const int exp_range = values == Values::integer ? kIntScaleExp : kRandomScaleExp;
  std::uniform_int_distribution<int> pow2(-exp_range, exp_range);
  std::uniform_real_distribution<float> log2_scale(-exp_range, exp_range);
  const int64_t scale_count = q.scale_inv.numel();
  x.scales.resize(static_cast<size_t>(scale_count));
  for (int64_t i = 0; i < scale_count; ++i) {
    if (mode == ScalingMode::mxfp8_1x32) {
      const auto e8m0 = static_cast<uint8_t>(fp8::kE8M0Bias + pow2(scale_rng));
      static_cast<uint8_t*>(q.scale_inv.raw_data())[i] = e8m0;
      x.scales[i] = fp8::decode_e8m0(e8m0);
    } else {
      const float s = values == Values::integer ? std::ldexp(1.0f, pow2(scale_rng))
                                                : std::exp2(log2_scale(scale_rng));
      q.scale_inv.data<float>()[i] = s;
      x.scales[i] = s;
    }
  }
  x.op = GemmOperand::fp8(q, /*use_transposed_copy=*/false, transpose);
  return x;
}

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
