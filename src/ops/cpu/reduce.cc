// CPU reference of the reductions: the same two-pass order as the CUDA kernels, so both backends
// produce identical bits.
#include <algorithm>
#include <vector>

#include "octet/fp8/format.h"
#include "ops/reduce_backend.h"

namespace octet::ops::cpu {
namespace {

float load(const Tensor& x, int64_t i) {
  if (x.dtype() == DType::f32) return static_cast<const float*>(x.raw_data())[i];
  return fp8::decode_bf16(static_cast<const uint16_t*>(x.raw_data())[i]);
}

}  // namespace

void sum_rows(const Tensor& x, const Tensor& out, bool accumulate) {
  const int64_t rows = x.rows();
  const int64_t cols = x.cols();
  const int64_t tiles = (rows + kSumRowsTileRows - 1) / kSumRowsTileRows;
  // First pass: one partial row per tile, the in-order sum of its runs' sequential sums.
  std::vector<float> partials(static_cast<size_t>(tiles * cols), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    float* partial = partials.data() + tile * cols;
    std::vector<float> run(static_cast<size_t>(cols));
    const int64_t end = std::min(rows, (tile + 1) * kSumRowsTileRows);
    for (int64_t begin = tile * kSumRowsTileRows; begin < end; begin += kSumRowsRunRows) {
      std::fill(run.begin(), run.end(), 0.0f);
      for (int64_t r = begin; r < std::min(end, begin + kSumRowsRunRows); ++r) {
        for (int64_t c = 0; c < cols; ++c) run[c] += load(x, r * cols + c);
      }
      for (int64_t c = 0; c < cols; ++c) partial[c] += run[c];
    }
  }
  // Second pass: the partials in tile order, after what out already holds.
  float* result = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < cols; ++c) {
    float sum = accumulate ? result[c] : 0.0f;
    for (int64_t tile = 0; tile < tiles; ++tile) sum += partials[tile * cols + c];
    result[c] = sum;
  }
}

}  // namespace octet::ops::cpu
