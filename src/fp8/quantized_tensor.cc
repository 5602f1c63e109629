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

namespace {

void check_format(DType dtype, int64_t cols, Usage usage) {
  OCTET_CHECK(is_fp8(dtype), "QuantizedTensor needs an FP8 dtype (e4m3 or e5m2), got ",
              dtype_name(dtype));
  OCTET_CHECK(cols > 0, "QuantizedTensor needs a non-empty matrix, got ", cols, " columns");
  OCTET_CHECK(usage.rowwise || usage.columnwise,
              "QuantizedTensor needs rowwise or columnwise usage (or both), got neither");
}

/// One flat buffer of `dtype` cut into aligned pieces: reserve() every piece's element count
/// first, then carve() them in the same order.
class Carver {
 public:
  explicit Carver(DType dtype) : dtype_(dtype) {}
  void reserve(int64_t elements) {
    const int64_t alignment =
        QuantizedTensor::kGroupAlignment / static_cast<int64_t>(dtype_size(dtype_));
    offsets_.push_back(round_up(end_, alignment));
    end_ = offsets_.back() + elements;
  }
  /// The next reserved piece, viewed as `shape`.
  Tensor carve(const Shape& shape, const Device& device) {
    if (!flat_.defined()) flat_ = Tensor::empty({end_}, dtype_, device);
    const int64_t begin = offsets_[next_++];
    return flat_.slice(begin, begin + shape_numel(shape)).view(shape);
  }

 private:
  DType dtype_;
  std::vector<int64_t> offsets_;
  int64_t end_ = 0;
  size_t next_ = 0;
  Tensor flat_;
};

}  // namespace

std::vector<QuantizedTensor> QuantizedTensor::allocate_groups(std::span<const int64_t> rows,
                                                              int64_t cols, DType dtype,
                                                              ScalingMode mode, Usage usage,
                                                              const Device& device) {
  check_format(dtype, cols, usage);
  std::vector<QuantizedTensor> groups(rows.size());
  Carver data(dtype), data_t(dtype), scales(scale_dtype(mode)), scales_t(scale_dtype(mode));
  const bool shared_scale = mode == ScalingMode::per_tensor && usage.rowwise;
  for (const int64_t r : rows) {
    OCTET_CHECK(r >= 0, "QuantizedTensor::allocate_groups: a group of ", r, " rows");
    if (r == 0) continue;
    if (usage.rowwise) {
      data.reserve(r * cols);
      scales.reserve(shape_numel(scale_shape(mode, r, cols)));
    }
    if (usage.columnwise) {
      data_t.reserve(r * cols);
      if (!shared_scale) scales_t.reserve(shape_numel(scale_shape(mode, cols, r)));
    }
  }
  for (size_t g = 0; g < rows.size(); ++g) {
    const int64_t r = rows[g];
    if (r == 0) continue;
    QuantizedTensor& q = groups[g];
    q.mode = mode;
    q.dtype = dtype;
    q.rows = r;
    q.cols = cols;
    if (usage.rowwise) {
      q.data = data.carve({r, cols}, device);
      q.scale_inv = scales.carve(scale_shape(mode, r, cols), device);
    }
    if (usage.columnwise) {
      q.data_t = data_t.carve({cols, r}, device);
      // per_tensor: one scale serves both copies
      q.scale_inv_t =
          shared_scale ? q.scale_inv : scales_t.carve(scale_shape(mode, cols, r), device);
    }
  }
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
