// GEMM test operands shared by the parity suite (gemm_test.cc) and the contract and argument
// tests (gemm_contract_test.cc): dense and FP8 operands on the CPU with their exact values, the
// FP8 ones written byte by byte (independent of the quantize op).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "octet/fp8/format.h"
#include "octet/fp8/quantized_tensor.h"
#include "octet/ops/gemm.h"
#include "test_util.h"

namespace octet::testing {

enum class Values { integer, random };

/// Integer inputs are drawn from [-kIntRange, kIntRange]: exact in bf16, e4m3 and e5m2.
inline constexpr int kIntRange = 4;
/// Integer-valued FP8 cases draw each block's scale_inv from 2^[-kIntScaleExp, kIntScaleExp], so
/// a wrong scale index changes the result while every product stays exact. The largest sum,
/// 4 * 4 * 2 * 2 * K with K = 8192 in steps of 1/4, needs 21 bits (< f32's 24).
inline constexpr int kIntScaleExp = 1;
/// Random FP8 cases draw scale_inv log-uniformly from 2^[-kRandomScaleExp, kRandomScaleExp].
inline constexpr int kRandomScaleExp = 4;

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
inline int64_t scale_index(fp8::ScalingMode mode, int64_t r, int64_t c, int64_t scale_cols) {
  switch (mode) {
    case fp8::ScalingMode::per_tensor:
      return 0;
    case fp8::ScalingMode::block_1x128:
      return r * scale_cols + c / fp8::kBlock;
    case fp8::ScalingMode::block_128x128:
      return (r / fp8::kBlock) * scale_cols + c / fp8::kBlock;
    case fp8::ScalingMode::mxfp8_1x32:
      return r * scale_cols + c / fp8::kMxBlock;
  }
  return 0;
}

/// A GEMM operand on the CPU together with its exact values, for the reference.
struct TestOperand {
  ops::GemmOperand op;
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
  ops::GemmOperand on(const Device& device) const {
    ops::GemmOperand x = op;
    x.data = op.data.to(device);
    if (op.scale_inv.defined()) x.scale_inv = op.scale_inv.to(device);
    return x;
  }
};

inline TestOperand make_dense(const Shape& stored, DType dtype, bool transpose, Values values,
                              uint64_t seed) {
  const Tensor t = values == Values::integer ? random_int_tensor(stored, dtype, seed, kIntRange)
                                             : random_tensor(stored, dtype, seed);
  TestOperand x;
  x.op = ops::GemmOperand::dense(t, transpose);
  x.dense = to_floats(t);
  return x;
}

/// An FP8 [rows, cols] operand, written byte by byte (independent of the quantize op).
/// Integer values: integers in [-kIntRange, kIntRange] with power-of-two scales. Random values:
/// any finite FP8 byte (subnormals and -0 included) with log-uniform scales.
inline TestOperand make_fp8(int64_t rows, int64_t cols, DType dtype, fp8::ScalingMode mode,
                            bool transpose, Values values, uint64_t seed) {
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
    if (mode == fp8::ScalingMode::mxfp8_1x32) {
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
  x.op = ops::GemmOperand::fp8(q, /*use_transposed_copy=*/false, transpose);
  return x;
}

}  // namespace octet::testing
