// CPU reference of the quantize family: the semantics every other backend matches bit for bit.
//
// Every scaling mode is one scheme: partition x into blocks (the whole matrix for per_tensor),
// take each block's amax, turn it into a multiplier and a scale_inv (scaling_math.h), encode
// fp8(x * multiplier). The row-wise copy uses the mode's blocks of x; the column-wise copy uses
// the transposed blocks of x and stores data and scale grid transposed. Loops run over rows or
// tiles with OpenMP; maxima are exact, so the thread count never changes a result.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/int_math.h"
#include "octet/fp8/format.h"
#include "octet/fp8/scaling_math.h"
#include "ops/quantize_backend.h"
#include "ops/reduce_backend.h"

namespace octet::ops::cpu {
namespace {

using fp8::QuantizedTensor;
using fp8::ScalingMode;

/// Side of the square tiles the transposed copy is written in: 64x64 inputs (16 KiB of f32) and
/// outputs (4 KiB) stay in L1 while the strided side is walked.
constexpr int64_t kTransposeTile = 64;

float load(const float* x, int64_t i) { return x[i]; }
float load(const uint16_t* x, int64_t i) { return fp8::decode_bf16(x[i]); }

/// Calls f(ptr) with the typed elements of an f32 (float) or bf16 (uint16_t bits) tensor.
template <typename F>
void visit_input(const Tensor& x, F&& f) {
  if (x.dtype() == DType::f32) {
    f(static_cast<const float*>(x.raw_data()));
  } else {
    f(static_cast<const uint16_t*>(x.raw_data()));
  }
}

/// max over abs_bits(x) of all elements.
template <typename T>
uint32_t max_abs_bits(const T* x, int64_t n) {
  uint32_t m = 0;
#pragma omp parallel for schedule(static) reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, fp8::abs_bits(load(x, i)));
  return m;
}

/// Folds amax_bits into element 0 of an f32 amax tensor (a max over raw bit patterns, as the
/// CUDA backend's atomicMax on the same word does).
void record_amax(const Tensor& amax_out, uint32_t amax_bits) {
  float* a = amax_out.data<float>();
  a[0] = fp8::bits_float(std::max(fp8::float_bits(a[0]), amax_bits));
}

/// A partition of a [rows, cols] matrix into blocks of block_rows x block_cols (edge blocks are
/// smaller), with lookup tables from a row or column to its block's row or column in the grid.
struct BlockGrid {
  int64_t block_rows, block_cols, grid_rows, grid_cols;
  std::vector<int64_t> row_block, col_block;

  BlockGrid(int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols)
      : block_rows(block_rows),
        block_cols(block_cols),
        grid_rows(ceil_div(rows, block_rows)),
        grid_cols(ceil_div(cols, block_cols)),
        row_block(rows),
        col_block(cols) {
    for (int64_t r = 0; r < rows; ++r) row_block[r] = r / block_rows;
    for (int64_t c = 0; c < cols; ++c) col_block[c] = c / block_cols;
  }
  int64_t rows() const { return static_cast<int64_t>(row_block.size()); }
  int64_t cols() const { return static_cast<int64_t>(col_block.size()); }
  int64_t size() const { return grid_rows * grid_cols; }
  /// Index of the block holding (r, c) in the row-major [grid_rows, grid_cols] grid.
  int64_t block_of(int64_t r, int64_t c) const { return row_block[r] * grid_cols + col_block[c]; }
  friend bool operator==(const BlockGrid& a, const BlockGrid& b) {
    return a.block_rows == b.block_rows && a.block_cols == b.block_cols &&
           a.grid_rows == b.grid_rows && a.grid_cols == b.grid_cols;
  }
};

/// Blocks of x (a [rows, cols] matrix) that scale its row-wise copy, or its column-wise copy.
BlockGrid blocks_of(ScalingMode mode, int64_t rows, int64_t cols, bool columnwise) {
  int64_t along_row = 0;  // block extent along a row of the quantized copy
  int64_t across = 1;     // ... and across rows
  switch (mode) {
    case ScalingMode::per_tensor:
      return BlockGrid(rows, cols, rows, cols);
    case ScalingMode::block_1x128:
      along_row = fp8::kBlock;
      break;
    case ScalingMode::block_128x128:
      along_row = across = fp8::kBlock;
      break;
    case ScalingMode::mxfp8_1x32:
      along_row = fp8::kMxBlock;
      break;
  }
  return columnwise ? BlockGrid(rows, cols, along_row, across)
                    : BlockGrid(rows, cols, across, along_row);
}

/// amax bits of every block of the grid, row-major.
template <typename T>
std::vector<uint32_t> block_amax(const T* x, const BlockGrid& g) {
  std::vector<uint32_t> amax(g.size(), 0);
  const int64_t rows = g.rows(), cols = g.cols();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < g.grid_rows; ++i) {
    uint32_t* a = &amax[i * g.grid_cols];
    const int64_t r_end = std::min(rows, (i + 1) * g.block_rows);
    for (int64_t r = i * g.block_rows; r < r_end; ++r) {
      const T* xr = x + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        uint32_t& m = a[g.col_block[c]];
        m = std::max(m, fp8::abs_bits(load(xr, c)));
      }
    }
  }
  return amax;
}

/// The multiplier of every block, and its scale_inv written into `scale_inv` (laid out as the
/// grid, or as its transpose for the column-wise copy).
std::vector<float> block_multipliers(const std::vector<uint32_t>& amax, const BlockGrid& g,
                                     ScalingMode mode, DType dtype, bool power_of_2,
                                     const Tensor& scale_inv, bool transposed) {
  const float fp8_max = fp8::fp8_max(dtype);
  std::vector<float> multiplier(g.size());
  for (int64_t i = 0; i < g.grid_rows; ++i) {
    for (int64_t j = 0; j < g.grid_cols; ++j) {
      const int64_t b = i * g.grid_cols + j;
      const int64_t out = transposed ? j * g.grid_rows + i : b;
      const float block_amax = fp8::bits_float(amax[b]);
      if (mode == ScalingMode::mxfp8_1x32) {
        const uint8_t e = fp8::mxfp8_scale_inv(block_amax, fp8_max);
        static_cast<uint8_t*>(scale_inv.raw_data())[out] = e;
        multiplier[b] = fp8::mxfp8_multiplier(e);
      } else {
        const float scale = fp8::block_scale(block_amax, fp8_max, power_of_2);
        scale_inv.data<float>()[out] = fp8::scale_inv_of(scale);
        multiplier[b] = scale;
      }
    }
  }
  return multiplier;
}

/// data[r][c] = fp8(x[r][c] * multiplier of its block), row by row.
template <typename T, DType kFp8>
void write_rowwise(const T* x, const BlockGrid& g, const float* multiplier, uint8_t* data) {
  const int64_t rows = g.rows(), cols = g.cols();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* m = multiplier + g.row_block[r] * g.grid_cols;
    for (int64_t c = 0; c < cols; ++c)
      data[r * cols + c] = fp8::quantize_value(load(x, r * cols + c), m[g.col_block[c]], kFp8);
  }
}

/// data_t[c][r] = code(r, c) for a [rows, cols] x, in square tiles so that both the strided reads
/// of x and the strided writes stay in cache.
template <typename Code>
void write_transposed_tiles(int64_t rows, int64_t cols, uint8_t* data_t, Code code) {
  const int64_t tile_rows = ceil_div(rows, kTransposeTile);
  const int64_t tile_cols = ceil_div(cols, kTransposeTile);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t ti = 0; ti < tile_rows; ++ti) {
    for (int64_t tj = 0; tj < tile_cols; ++tj) {
      const int64_t r0 = ti * kTransposeTile, r1 = std::min(rows, r0 + kTransposeTile);
      const int64_t c0 = tj * kTransposeTile, c1 = std::min(cols, c0 + kTransposeTile);
      for (int64_t c = c0; c < c1; ++c) {
        uint8_t* out = data_t + c * rows;
        for (int64_t r = r0; r < r1; ++r) out[r] = code(r, c);
      }
    }
  }
}

/// data_t[c][r] = fp8(x[r][c] * multiplier of its block).
template <typename T, DType kFp8>
void write_transposed(const T* x, const BlockGrid& g, const float* multiplier, uint8_t* data_t) {
  const int64_t cols = g.cols();
  write_transposed_tiles(g.rows(), cols, data_t, [&g, x, multiplier, cols](int64_t r, int64_t c) {
    return fp8::quantize_value(load(x, r * cols + c), multiplier[g.block_of(r, c)], kFp8);
  });
}

/// data_t[c][r] = data[r][c]: the transposed copy when its codes are the row-wise ones (the two
/// copies share their blocks and multipliers).
void transpose_codes(const uint8_t* data, int64_t rows, int64_t cols, uint8_t* data_t) {
  write_transposed_tiles(rows, cols, data_t,
                         [=](int64_t r, int64_t c) { return data[r * cols + c]; });
}

/// Multipliers and block amaxes of one copy (row-wise or column-wise) of x.
struct ScaledBlocks {
  BlockGrid grid;
  std::vector<uint32_t> amax;  ///< empty for per_tensor (its scale is given)
  std::vector<float> multiplier;
};

/// Scales one copy: its grid, block amaxes and multipliers; writes its scale_inv.
template <typename T>
ScaledBlocks scale_copy(const T* x, const QuantizedTensor& out, const QuantizeArgs& args,
                        bool columnwise) {
  const Tensor& scale_inv = columnwise ? out.scale_inv_t : out.scale_inv;
  ScaledBlocks s{blocks_of(out.mode, out.rows, out.cols, columnwise), {}, {}};
  if (out.mode == ScalingMode::per_tensor) {
    const float scale = args.scale.data<float>()[0];
    scale_inv.data<float>()[0] = fp8::scale_inv_of(scale);
    s.multiplier.assign(1, scale);
  } else {
    s.amax = block_amax(x, s.grid);
    s.multiplier = block_multipliers(s.amax, s.grid, out.mode, out.dtype,
                                     args.power_of_2_block_scales, scale_inv, columnwise);
  }
  return s;
}

template <typename T, DType kFp8>
void quantize_typed(const T* x, QuantizedTensor& out, const QuantizeArgs& args) {
  ScaledBlocks rowwise{blocks_of(out.mode, out.rows, out.cols, false), {}, {}};
  if (out.has_rowwise()) {
    rowwise = scale_copy(x, out, args, false);
    write_rowwise<T, kFp8>(x, rowwise.grid, rowwise.multiplier.data(),
                           static_cast<uint8_t*>(out.data.raw_data()));
  }
  const ScaledBlocks* amax_source = out.has_rowwise() ? &rowwise : nullptr;
  ScaledBlocks columnwise{blocks_of(out.mode, out.rows, out.cols, true), {}, {}};
  if (out.has_columnwise()) {
    // 128x128 tiles (and the single per-tensor block) are shared: the row-wise scales are the
    // column-wise ones, so each transposed code is the row-wise code of the same element. Only
    // scale_inv_t is laid out as the transposed grid, and the codes are transposed bytes.
    if (out.has_rowwise() && columnwise.grid == rowwise.grid) {
      if (out.mode == ScalingMode::per_tensor) {
        out.scale_inv_t.data<float>()[0] = out.scale_inv.data<float>()[0];
      } else {
        block_multipliers(rowwise.amax, rowwise.grid, out.mode, out.dtype,
                          args.power_of_2_block_scales, out.scale_inv_t, true);
      }
      transpose_codes(static_cast<const uint8_t*>(out.data.raw_data()), out.rows, out.cols,
                      static_cast<uint8_t*>(out.data_t.raw_data()));
    } else {
      columnwise = scale_copy(x, out, args, true);
      amax_source = &columnwise;
      write_transposed<T, kFp8>(x, columnwise.grid, columnwise.multiplier.data(),
                                static_cast<uint8_t*>(out.data_t.raw_data()));
    }
  }
  if (args.amax.defined()) {
    // Published after every store above (DESIGN.md rule 1). Block amaxes already cover x.
    const std::vector<uint32_t>& blocks = amax_source->amax;
    const uint32_t m = blocks.empty() ? max_abs_bits(x, out.rows * out.cols)
                                      : *std::max_element(blocks.begin(), blocks.end());
    record_amax(args.amax, m);
  }
}

}  // namespace

void amax(const Tensor& x, const Tensor& amax_out) {
  visit_input(x, [&](const auto* p) { record_amax(amax_out, max_abs_bits(p, x.numel())); });
}

void quantize(const Tensor& x, QuantizedTensor& out, const QuantizeArgs& args) {
  visit_input(x, [&](const auto* p) {
    visit_fp8(out.dtype, [&](auto fp8_tag) {
      quantize_typed<std::remove_cv_t<std::remove_pointer_t<decltype(p)>>,
                     decltype(fp8_tag)::value>(p, out, args);
    });
  });
  if (args.column_sums.defined()) sum_rows(x, args.column_sums, args.accumulate_column_sums);
}

void quantize_groups(const Tensor& x, std::span<const int64_t> offsets,
                     std::span<const FusedQuantize> targets) {
  const Tensor matrix = x.view({-1, x.cols()});
  for (size_t g = 0; g < targets.size(); ++g) {
    if (offsets[g + 1] == offsets[g] || targets[g].out == nullptr) continue;
    cpu::quantize(matrix.slice(offsets[g], offsets[g + 1]), *targets[g].out, targets[g].args);
  }
}

void dequantize(const QuantizedTensor& q, const Tensor& out, bool transposed) {
  const Tensor& data = transposed ? q.data_t : q.data;
  const Tensor& scale_inv = transposed ? q.scale_inv_t : q.scale_inv;
  const int64_t rows = data.size(0), cols = data.size(1);
  // The stored copy's scales are laid out for its own [rows, cols] by the row-wise rule.
  const BlockGrid g = blocks_of(q.mode, rows, cols, false);
  std::vector<float> scale(g.size());
  for (int64_t b = 0; b < g.size(); ++b) {
    scale[b] = q.mode == ScalingMode::mxfp8_1x32
                   ? fp8::decode_e8m0(static_cast<const uint8_t*>(scale_inv.raw_data())[b])
                   : scale_inv.data<float>()[b];
  }
  const auto* in = static_cast<const uint8_t*>(data.raw_data());
  // The output type is a template parameter of the loop, so its branch leaves the inner loop.
  auto run = [&](auto* o, auto fp8_tag) {
    constexpr DType kFp8 = decltype(fp8_tag)::value;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* s = scale.data() + g.row_block[r] * g.grid_cols;
      for (int64_t c = 0; c < cols; ++c) {
        const float v = fp8::dequantize_value(in[r * cols + c], s[g.col_block[c]], kFp8);
        if constexpr (std::is_same_v<decltype(o), float*>) {
          o[r * cols + c] = v;
        } else {
          o[r * cols + c] = fp8::encode_bf16(v);
        }
      }
    }
  };
  visit_fp8(q.dtype, [&](auto fp8_tag) {
    if (out.dtype() == DType::bf16) {
      run(static_cast<uint16_t*>(out.raw_data()), fp8_tag);
    } else {
      run(static_cast<float*>(out.raw_data()), fp8_tag);
    }
  });
}

void cast(const Tensor& x, const Tensor& out) {
  const int64_t n = x.numel();
  if (x.dtype() == out.dtype()) {
    std::memcpy(out.raw_data(), x.raw_data(), x.nbytes());
  } else if (x.dtype() == DType::f32) {
    const float* in = x.data<float>();
    auto* o = static_cast<uint16_t*>(out.raw_data());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) o[i] = fp8::encode_bf16(in[i]);
  } else {
    const auto* in = static_cast<const uint16_t*>(x.raw_data());
    float* o = out.data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) o[i] = fp8::decode_bf16(in[i]);
  }
}

void count_fp8_codes(const Tensor& x, const Tensor& codes, const Tensor& counts) {
  const uint8_t max_code = fp8::encode_fp8(fp8::fp8_max(codes.dtype()), codes.dtype());
  const auto* c = static_cast<const uint8_t*>(codes.raw_data());
  const int64_t n = x.numel();
  int64_t saturated = 0, underflow = 0, nonzero = 0;
  visit_input(x, [&](const auto* p) {
  // Integer sums: the result does not depend on how OpenMP splits the loop.
#pragma omp parallel for reduction(+ : saturated, underflow, nonzero)
    for (int64_t i = 0; i < n; ++i) {
      int64_t local[3] = {0, 0, 0};
      count_fp8_code(load(p, i), c[i], max_code, local);
      saturated += local[kSaturatedCodes];
      underflow += local[kUnderflowCodes];
      nonzero += local[kNonzeroInputs];
    }
  });
  int64_t* out = counts.data<int64_t>();
  out[kSaturatedCodes] += saturated;
  out[kUnderflowCodes] += underflow;
  out[kNonzeroInputs] += nonzero;
}

}  // namespace octet::ops::cpu
