#include "octet/fp8/quantized_tensor.h"

#include "core/int_math.h"

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

QuantizedTensor QuantizedTensor::allocate(int64_t rows, int64_t cols, DType dtype,
                                          ScalingMode mode, Usage usage, const Device& device) {
  OCTET_CHECK(is_fp8(dtype), "QuantizedTensor needs an FP8 dtype (e4m3 or e5m2), got ",
              dtype_name(dtype));
  OCTET_CHECK(rows > 0 && cols > 0, "QuantizedTensor needs a non-empty matrix, got [", rows, ", ",
              cols, "]");
  OCTET_CHECK(usage.rowwise || usage.columnwise,
              "QuantizedTensor needs rowwise or columnwise usage (or both), got neither");
  QuantizedTensor q;
  q.mode = mode;
  q.dtype = dtype;
  q.rows = rows;
  q.cols = cols;
  const DType sdt = scale_dtype(mode);
  if (usage.rowwise) {
    q.data = Tensor::empty({rows, cols}, dtype, device);
    q.scale_inv = Tensor::empty(scale_shape(mode, rows, cols), sdt, device);
  }
  if (usage.columnwise) {
    q.data_t = Tensor::empty({cols, rows}, dtype, device);
    if (mode == ScalingMode::per_tensor && usage.rowwise) {
      q.scale_inv_t = q.scale_inv;  // one scale serves both copies
    } else {
      q.scale_inv_t = Tensor::empty(scale_shape(mode, cols, rows), sdt, device);
    }
  }
  return q;
}

const Device& QuantizedTensor::device() const {
  return has_rowwise() ? data.device() : data_t.device();
}

}  // namespace octet::fp8
