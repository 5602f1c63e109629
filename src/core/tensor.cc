#include "octet/core/tensor.h"

#include <algorithm>
#include <sstream>

#include "octet/core/allocator.h"

namespace octet {

std::string shape_str(const Shape& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

Storage::Storage(size_t bytes, const Device& device)
    : data_(device_alloc(bytes, device)), bytes_(bytes), device_(device) {}

Storage::Storage(void* data, size_t bytes, const Device& device, std::function<void()> release)
    : data_(data), bytes_(bytes), device_(device), release_(std::move(release)) {}

Storage::~Storage() {
  if (release_) {
    release_();
  } else {
    device_free(data_, device_);
  }
}

Tensor Tensor::empty(const Shape& shape, DType dtype, const Device& device) {
  for (int64_t extent : shape)
    OCTET_CHECK(extent >= 0, "tensor extents must be non-negative, got shape ", shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(t.nbytes(), device);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, const Device& device) {
  Tensor t = empty(shape, dtype, device);
  t.zero();
  return t;
}

Tensor Tensor::from_vector(const std::vector<float>& values, const Shape& shape) {
  OCTET_CHECK(shape_numel(shape) == static_cast<int64_t>(values.size()), "shape ",
              shape_str(shape), " holds ", shape_numel(shape), " elements, got ", values.size(),
              " values");
  Tensor t = empty(shape, DType::f32);
  std::copy(values.begin(), values.end(), t.data<float>());
  return t;
}

Tensor Tensor::adopt(std::shared_ptr<Storage> storage, const Shape& shape, DType dtype) {
  OCTET_CHECK(storage != nullptr, "Tensor::adopt needs a storage");
  Tensor t = view_of(storage, 0, shape, dtype);
  OCTET_CHECK(t.nbytes() == storage->bytes(), "Tensor::adopt: shape ", shape_str(shape), " of ",
              dtype_name(dtype), " needs ", t.nbytes(), " bytes, the storage holds ",
              storage->bytes());
  return t;
}

Tensor Tensor::view_of(std::shared_ptr<Storage> storage, size_t offset_bytes, const Shape& shape,
                       DType dtype) {
  OCTET_CHECK(storage != nullptr, "Tensor::view_of needs a storage");
  for (int64_t extent : shape)
    OCTET_CHECK(extent >= 0, "tensor extents must be non-negative, got shape ", shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  OCTET_CHECK(offset_bytes % dtype_size(dtype) == 0 && offset_bytes <= storage->bytes() &&
                  t.nbytes() <= storage->bytes() - offset_bytes,
              "Tensor::view_of: ", t.nbytes(), " bytes of ", dtype_name(dtype), " at byte ",
              offset_bytes, " do not fit, aligned, in a storage of ", storage->bytes());
  t.storage_ = std::move(storage);
  t.offset_bytes_ = offset_bytes;
  return t;
}

const Device& Tensor::device() const {
  OCTET_CHECK(defined(), "use of an undefined tensor");
  return storage_->device();
}

int64_t Tensor::size(int i) const {
  int n = ndim();
  int index = i < 0 ? i + n : i;
  OCTET_CHECK(index >= 0 && index < n, "dimension ", i, " out of range for shape ",
              shape_str(shape_));
  return shape_[index];
}

int64_t Tensor::rows() const {
  OCTET_CHECK(ndim() >= 1, "expected a tensor with at least 1 dimension, got shape []");
  return ndim() == 1 ? 1 : numel() / shape_.back();
}

int64_t Tensor::cols() const {
  OCTET_CHECK(ndim() >= 1, "expected a tensor with at least 1 dimension, got shape []");
  return shape_.back();
}

void* Tensor::raw_data() const {
  OCTET_CHECK(defined(), "use of an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_bytes_;
}

void Tensor::check_element_type(size_t element_size, int dtype_code) const {
  OCTET_CHECK(defined(), "use of an undefined tensor");
  OCTET_CHECK(element_size == dtype_size(dtype_),
              "element type of size ", element_size, " does not match tensor dtype ",
              dtype_name(dtype_));
  OCTET_CHECK(dtype_code < 0 || dtype_code == static_cast<int>(dtype_), "expected dtype ",
              dtype_code >= 0 ? dtype_name(static_cast<DType>(dtype_code)) : "?", ", got ",
              dtype_name(dtype_));
}

Tensor Tensor::view(const Shape& shape) const {
  OCTET_CHECK(defined(), "use of an undefined tensor");
  Shape resolved = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < resolved.size(); ++i) {
    if (resolved[i] == -1) {
      OCTET_CHECK(infer < 0, "view shape ", shape_str(shape), " has more than one -1");
      infer = static_cast<int>(i);
    } else {
      known *= resolved[i];
    }
  }
  if (infer >= 0) {
    OCTET_CHECK(known > 0 && numel() % known == 0, "cannot view ", describe(), " as ",
                shape_str(shape));
    resolved[infer] = numel() / known;
  }
  OCTET_CHECK(shape_numel(resolved) == numel(), "cannot view ", describe(), " as ",
              shape_str(shape), ": element counts differ");
  Tensor t = *this;
  t.shape_ = resolved;
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  OCTET_CHECK(ndim() >= 1, "slice of a scalar tensor");
  OCTET_CHECK(0 <= begin && begin <= end && end <= shape_[0], "slice [", begin, ", ", end,
              ") out of range for ", describe());
  Tensor t = *this;
  t.shape_[0] = end - begin;
  t.offset_bytes_ += static_cast<size_t>(begin * (numel() / std::max<int64_t>(shape_[0], 1))) *
                     dtype_size(dtype_);
  return t;
}

Tensor Tensor::to(const Device& device) const {
  Tensor t = empty(shape_, dtype_, device);
  copy_bytes(t.raw_data(), device, raw_data(), this->device(), nbytes());
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  OCTET_CHECK(src.shape_ == shape_ && src.dtype_ == dtype_, "copy_from expects ", describe(),
              ", got ", src.describe());
  copy_bytes(raw_data(), device(), src.raw_data(), src.device(), nbytes());
}

void Tensor::zero() { zero_bytes(raw_data(), device(), nbytes()); }

std::string Tensor::describe() const {
  if (!defined()) return "undefined tensor";
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " on " + device().str();
}

float item_f32(const Tensor& t) {
  OCTET_CHECK(t.defined() && t.dtype() == DType::f32 && t.numel() >= 1,
              "item_f32 expects a non-empty f32 tensor, got ", t.describe());
  float value = 0;
  copy_bytes(&value, Device::cpu(), t.raw_data(), t.device(), sizeof(float));
  return value;
}

std::vector<float> host_values_f32(const Tensor& t) {
  OCTET_CHECK(t.defined() && t.dtype() == DType::f32, "host_values_f32 expects an f32 tensor, got ",
              t.describe());
  std::vector<float> values(t.numel());
  copy_bytes(values.data(), Device::cpu(), t.raw_data(), t.device(), t.nbytes());
  return values;
}

Device common_device(std::initializer_list<const Tensor*> tensors, const char* op) {
  const Tensor* first = nullptr;
  for (const Tensor* t : tensors) {
    if (t == nullptr) continue;
    OCTET_CHECK(t->defined(), op, ": received an undefined tensor");
    if (first == nullptr) {
      first = t;
      continue;
    }
    OCTET_CHECK(t->device() == first->device(), op, ": all tensors must be on one device, got ",
                first->describe(), " and ", t->describe());
  }
  OCTET_CHECK(first != nullptr, op, ": no tensors given");
  return first->device();
}

}  // namespace octet
