// Scalar reference of the quantize family for tests, written from the semantics in
// docs/NUMERICS.md with plain loops. It shares nothing with src/ops and fp8/scaling_math.h: only
// the scalar format codecs of fp8/format.h, which tests/fp8/format_test.cc proves over every bit
// pattern. Loops are parallel over blocks only so that the 16384x8192 GPU cases stay quick.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "octet/core/tensor.h"
#include "octet/fp8/format.h"
#include "octet/fp8/quantized_tensor.h"

namespace octet::testing::ref {

/// The bit pattern of |x|; a max over these lets NaN win and ignores the order.
inline uint32_t abs_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits & 0x7FFFFFFFu;
}

inline float from_bits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline uint32_t to_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

/// max over the bit patterns of `initial` and of |x| for every x.
inline float amax(const std::vector<float>& x, float initial) {
  // A max of integers: the same in any order, so the threads may split it.
  uint32_t m = to_bits(initial);
  const int64_t n = static_cast<int64_t>(x.size());
#pragma omp parallel for reduction(max : m) schedule(static)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, abs_bits(x[i]));
  return from_bits(m);
}

/// fp8_max / amax; 1 for amax 0, inf or NaN; FLT_MAX on overflow; optionally 2^floor(log2(.)).
inline float block_scale(float amax, float fp8_max, bool power_of_2) {
  if (amax == 0.0f || !std::isfinite(amax)) return 1.0f;
  float scale = fp8_max / amax;
  if (std::isinf(scale)) scale = FLT_MAX;
  if (power_of_2) {
    int exponent = 0;
    std::frexp(scale, &exponent);  // scale = m * 2^exponent, m in [0.5, 1)
    scale = std::ldexp(1.0f, exponent - 1);
  }
  return scale;
}

/// One quantized copy, kept in x's orientation: q[r][c] is x[r][c] quantized with the scale of
/// the block_rows x block_cols block of x holding it.
struct Copy {
  int64_t rows = 0, cols = 0, block_rows = 0, block_cols = 0, grid_rows = 0, grid_cols = 0;
  fp8::ScalingMode mode = fp8::ScalingMode::per_tensor;
  std::vector<uint8_t> q;
  std::vector<float> scale_inv;         ///< f32 modes: [grid_rows, grid_cols]
  std::vector<uint8_t> scale_inv_e8m0;  ///< mxfp8: [grid_rows, grid_cols]
  /// The dequantization factor of the block holding x[r][c].
  float scale_inv_at(int64_t r, int64_t c) const {
    const int64_t b = (r / block_rows) * grid_cols + c / block_cols;
    return mode == fp8::ScalingMode::mxfp8_1x32 ? fp8::decode_e8m0(scale_inv_e8m0[b])
                                                : scale_inv[b];
  }
};

/// Quantizes x [rows, cols] in blocks of block_rows x block_cols under `mode`.
inline Copy quantize_copy(const std::vector<float>& x, int64_t rows, int64_t cols,
                          int64_t block_rows, int64_t block_cols, fp8::ScalingMode mode,
                          DType dtype, float tensor_scale, bool power_of_2) {
  Copy out;
  out.rows = rows;
  out.cols = cols;
  out.block_rows = block_rows;
  out.block_cols = block_cols;
  out.grid_rows = (rows + block_rows - 1) / block_rows;
  out.grid_cols = (cols + block_cols - 1) / block_cols;
  out.mode = mode;
  out.q.resize(x.size());
  out.scale_inv.resize(out.grid_rows * out.grid_cols);
  out.scale_inv_e8m0.resize(out.grid_rows * out.grid_cols);
  const float fp8_max = fp8::fp8_max(dtype);
  // The blocks' multipliers first, then the elements by row: a per-tensor copy is one block, and
  // its 2^27 elements at the large shapes must not run on one thread.
  std::vector<float> multipliers(out.scale_inv.size());
#pragma omp parallel for schedule(dynamic)
  for (int64_t bi = 0; bi < out.grid_rows; ++bi) {
    for (int64_t bj = 0; bj < out.grid_cols; ++bj) {
      const int64_t b = bi * out.grid_cols + bj;
      if (mode == fp8::ScalingMode::per_tensor) {  // the amax is not needed
        multipliers[b] = tensor_scale;
        out.scale_inv[b] = 1.0f / tensor_scale;
        continue;
      }
      const int64_t r0 = bi * block_rows, r1 = std::min(rows, r0 + block_rows);
      const int64_t c0 = bj * block_cols, c1 = std::min(cols, c0 + block_cols);
      uint32_t block_amax_bits = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          block_amax_bits = std::max(block_amax_bits, abs_bits(x[r * cols + c]));
      const float block_amax = from_bits(block_amax_bits);
      if (mode == fp8::ScalingMode::mxfp8_1x32) {
        const uint8_t e = fp8::encode_e8m0_round_up(block_amax / fp8_max);
        out.scale_inv_e8m0[b] = e;
        // 1 / 2^(e - 127), exact; a NaN scale makes every element NaN.
        multipliers[b] = e == 0xFF ? NAN : std::ldexp(1.0f, 127 - static_cast<int>(e));
      } else {  // block_1x128, block_128x128
        multipliers[b] = block_scale(block_amax, fp8_max, power_of_2);
        out.scale_inv[b] = 1.0f / multipliers[b];
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* block_row = multipliers.data() + (r / block_rows) * out.grid_cols;
    for (int64_t c = 0; c < cols; ++c)
      out.q[r * cols + c] = fp8::encode_fp8(x[r * cols + c] * block_row[c / block_cols], dtype);
  }
  return out;
}

/// Block extents (in x's rows, cols) of the row-wise or the column-wise copy under `mode`.
inline void copy_blocks(fp8::ScalingMode mode, int64_t rows, int64_t cols, bool columnwise,
                        int64_t* block_rows, int64_t* block_cols) {
  switch (mode) {
    case fp8::ScalingMode::per_tensor:
      *block_rows = rows, *block_cols = cols;
      return;
    case fp8::ScalingMode::block_1x128:
      *block_rows = 1, *block_cols = 128;
      break;
    case fp8::ScalingMode::block_128x128:
      *block_rows = 128, *block_cols = 128;
      break;
    case fp8::ScalingMode::mxfp8_1x32:
      *block_rows = 1, *block_cols = 32;
      break;
  }
  if (columnwise) std::swap(*block_rows, *block_cols);
}

/// The expected quantization: both copies (x's orientation) and the output tensors on the CPU.
struct Quantized {
  Copy rowwise, columnwise;
  fp8::QuantizedTensor tensor;
};

inline Quantized quantize(const std::vector<float>& x, int64_t rows, int64_t cols, DType dtype,
                          fp8::ScalingMode mode, fp8::Usage usage, float tensor_scale,
                          bool power_of_2) {
  Quantized out;
  out.tensor = fp8::QuantizedTensor::allocate(rows, cols, dtype, mode, usage, Device::cpu());
  const bool e8m0 = mode == fp8::ScalingMode::mxfp8_1x32;
  int64_t br = 0, bc = 0;
  if (usage.rowwise) {
    copy_blocks(mode, rows, cols, false, &br, &bc);
    out.rowwise = quantize_copy(x, rows, cols, br, bc, mode, dtype, tensor_scale, power_of_2);
    const Copy& k = out.rowwise;
    std::memcpy(out.tensor.data.raw_data(), k.q.data(), k.q.size());
    for (int64_t b = 0; b < k.grid_rows * k.grid_cols; ++b) {
      if (e8m0) {
        static_cast<uint8_t*>(out.tensor.scale_inv.raw_data())[b] = k.scale_inv_e8m0[b];
      } else {
        out.tensor.scale_inv.data<float>()[b] = k.scale_inv[b];
      }
    }
  }
  if (usage.columnwise) {
    copy_blocks(mode, rows, cols, true, &br, &bc);
    out.columnwise = quantize_copy(x, rows, cols, br, bc, mode, dtype, tensor_scale, power_of_2);
    const Copy& k = out.columnwise;
    auto* data_t = static_cast<uint8_t*>(out.tensor.data_t.raw_data());
#pragma omp parallel for
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) data_t[c * rows + r] = k.q[r * cols + c];
    for (int64_t i = 0; i < k.grid_rows; ++i) {
      for (int64_t j = 0; j < k.grid_cols; ++j) {
        const int64_t from = i * k.grid_cols + j, to = j * k.grid_rows + i;  // transposed grid
        if (e8m0) {
          static_cast<uint8_t*>(out.tensor.scale_inv_t.raw_data())[to] = k.scale_inv_e8m0[from];
        } else {
          out.tensor.scale_inv_t.data<float>()[to] = k.scale_inv[from];
        }
      }
    }
  }
  return out;
}

/// decode(q) * scale_inv of its block for one copy; [rows, cols], or [cols, rows] for the
/// column-wise copy (transposed), in out_dtype (f32, or bf16 rounded from the f32 product).
inline Tensor dequantize(const Copy& k, DType dtype, DType out_dtype, bool transposed) {
  Tensor out = transposed ? Tensor::empty({k.cols, k.rows}, out_dtype)
                          : Tensor::empty({k.rows, k.cols}, out_dtype);
  auto* f32 = static_cast<float*>(out.raw_data());
  auto* bf16 = static_cast<uint16_t*>(out.raw_data());
  // By row, not by block: a per-tensor copy is one block.
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < k.rows; ++r) {
    for (int64_t c = 0; c < k.cols; ++c) {
      const float v = fp8::decode_fp8(k.q[r * k.cols + c], dtype) * k.scale_inv_at(r, c);
      const int64_t i = transposed ? c * k.rows + r : r * k.cols + c;
      if (out_dtype == DType::f32) {
        f32[i] = v;
      } else {
        bf16[i] = fp8::encode_bf16(v);
      }
    }
  }
  return out;
}

}  // namespace octet::testing::ref
