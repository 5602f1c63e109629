#include "octet/fp8/quantized_tensor.h"

#include "core/int_math.h"
#include "octet/core/carve.h"

namespace octet::fp8 {

std::string_view scaling_mode_name(ScalingMode mode) {
  switch (mode) {
    case ScalingMode::per_tensor: return "per_tensor";
    case ScalingMode::block_1x128: return "block_1x128";
    case ScalingMode::block_128x128: return "block_128x128";
    case ScalingMode::mxfp8_1x32: return "mxfp8_1x32";
  }
  return "?";
}

Shape scale_shape(ScalingMode mode, int64_t rows, int64_t cols) {
  switch (mode) {
    case ScalingMode::per_tensor: return {1};
    case ScalingMode::block_1x128: return {rows, ceil_div(cols, kBlock)};
    case ScalingMode::block_128x128: return {ceil_div(rows, kBlock), ceil_div(cols, kBlock)};
    case ScalingMode::mxfp8_1x32: return {rows, ceil_div(cols, kMxBlock)};
  }
  OCTET_ERROR("unknown scaling mode ", static_cast<int>(mode));
}

DType scale_dtype(ScalingMode mode) {
  return mode == ScalingMode::mxfp8_1x32 ? DType::e8m0 : DType::f32;
}

namespace {

void check_format(DType dtype, int64_t cols, Usage usage) {
  OCTET_CHECK(is_fp8(dtype), "QuantizedTensor needs an FP8 dtype (e4m3 or e5m2), got ",
              dtype_name(dtype));
  OCTET_CHECK(cols > 0, "QuantizedTensor needs a non-empty matrix, got ", cols, " columns");
  OCTET_CHECK(usage.rowwise || usage.columnwise,
              "QuantizedTensor needs rowwise or columnwise usage (or both), got neither");
}

}  // namespace

std::vector<QuantizedTensor> QuantizedTensor::allocate_groups(std::span<const int64_t> rows,
                                                              int64_t cols, DType dtype,
                                                              ScalingMode mode, Usage usage,
                                                              const Device& device) {
  check_format(dtype, cols, usage);
  const DType scale_type = scale_dtype(mode);
  for (int64_t r : rows)
    OCTET_CHECK(r >= 0, "QuantizedTensor::allocate_groups: a group of ", r, " rows");
  // Two allocations at most: the row-wise copies with their scales, the transposed copies with
  // theirs, so that dropping the row-wise copies after a forward frees their memory. The one
  // scale that per_tensor's copies share lives with the transposed copies, kept for the
  // backward. Scales come first, so the data pieces follow one another to the end.
  TensorCarver rowwise(device, kGroupAlignment), columnwise(device, kGroupAlignment);
  const bool shared_scale = mode == ScalingMode::per_tensor && usage.rowwise && usage.columnwise;
  std::vector<QuantizedTensor> groups(rows.size());
  for (size_t g = 0; g < rows.size(); ++g) {
    if (rows[g] == 0) continue;
    QuantizedTensor& q = groups[g];
    q.mode = mode;
    q.dtype = dtype;
    q.rows = rows[g];
    q.cols = cols;
    if (shared_scale) {
      columnwise.place(scale_shape(mode, q.rows, cols), scale_type, &q.scale_inv, &q.scale_inv_t);
    } else {
      if (usage.rowwise) rowwise.place(scale_shape(mode, q.rows, cols), scale_type, &q.scale_inv);
      if (usage.columnwise) {
        columnwise.place(scale_shape(mode, cols, q.rows), scale_type, &q.scale_inv_t);
      }
    }
  }
  for (QuantizedTensor& q : groups) {
    if (q.rows == 0) continue;
    if (usage.rowwise) rowwise.place({q.rows, cols}, dtype, &q.data);
    if (usage.columnwise) columnwise.place({cols, q.rows}, dtype, &q.data_t);
  }
  rowwise.allocate();
  columnwise.allocate();
  return groups;
}

QuantizedTensor QuantizedTensor::allocate(int64_t rows, int64_t cols, DType dtype,
                                          ScalingMode mode, Usage usage, const Device& device) {
  OCTET_CHECK(rows > 0, "QuantizedTensor needs a non-empty matrix, got [", rows, ", ", cols, "]");
  return std::move(allocate_groups(std::span(&rows, 1), cols, dtype, mode, usage, device).front());
}

const Device& QuantizedTensor::device() const {
  return has_rowwise() ? data.device() : data_t.device();
}

}  // namespace octet::fp8
