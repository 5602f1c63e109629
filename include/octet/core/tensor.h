// Tensor: a shape, a dtype, a device and shared storage. Always contiguous and row-major.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "octet/core/device.h"
#include "octet/core/dtype.h"
#include "octet/core/error.h"

namespace octet {

using Shape = std::vector<int64_t>;

/// "[2, 3]".
std::string shape_str(const Shape& shape);
/// Product of the extents (1 for a scalar shape {}).
int64_t shape_numel(const Shape& shape);

/// Memory owned by one allocation; freed when the last Tensor using it goes away.
class Storage {
 public:
  Storage(size_t bytes, const Device& device);
  /// Memory that someone else owns (a DLPack producer): used in place, never copied; `release`
  /// runs instead of a free when the last Tensor using it goes away.
  Storage(void* data, size_t bytes, const Device& device, std::function<void()> release);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  const Device& device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
  std::function<void()> release_;  ///< set for external memory
};

class Tensor {
 public:
  /// An undefined tensor (defined() is false).
  Tensor() = default;

  /// Uninitialized memory.
  static Tensor empty(const Shape& shape, DType dtype, const Device& device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, const Device& device = Device::cpu());
  /// A CPU f32 tensor holding `values`, reshaped to `shape`.
  static Tensor from_vector(const std::vector<float>& values, const Shape& shape);
  /// A tensor over all of `storage` (which must hold exactly shape x dtype bytes), e.g. external
  /// memory that the C API wraps without a copy.
  static Tensor adopt(std::shared_ptr<Storage> storage, const Shape& shape, DType dtype);
  /// A tensor of `shape` x `dtype` over `storage`'s bytes from `offset_bytes` (inside the storage
  /// and a multiple of the element size), e.g. one piece of a TensorCarver's allocation.
  static Tensor view_of(std::shared_ptr<Storage> storage, size_t offset_bytes, const Shape& shape,
                        DType dtype);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  /// Extent of dimension i; negative i counts from the end.
  int64_t size(int i) const;
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  const Device& device() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  /// Rows and columns when viewed as a matrix: all leading dims are folded into rows.
  int64_t rows() const;
  int64_t cols() const;

  void* raw_data() const;
  /// The shared storage (the C API hands it out with exported views to keep them alive).
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  /// Typed pointer; throws unless sizeof(T) matches the dtype's element size and, for types with
  /// a dtype_of mapping, the dtype itself.
  template <typename T>
  T* data() const {
    check_element_type(sizeof(T), dtype_of_or_none<T>());
    return static_cast<T*>(raw_data());
  }

  /// Same storage, new shape with the same element count. One extent may be -1.
  Tensor view(const Shape& shape) const;
  /// Entries [begin, end) along dimension 0, sharing storage (row-major makes this contiguous).
  Tensor slice(int64_t begin, int64_t end) const;
  /// A copy on `device` (a new allocation even when the device is the same).
  Tensor to(const Device& device) const;
  Tensor clone() const { return to(device()); }
  /// Copies `src` (same shape and dtype, any device) into this tensor.
  void copy_from(const Tensor& src);
  /// Sets every byte to zero.
  void zero();

  /// "f32[2, 3] on cpu" for messages.
  std::string describe() const;

 private:
  template <typename T>
  static constexpr int dtype_of_or_none() {
    if constexpr (requires { dtype_of<T>::value; }) return static_cast<int>(dtype_of<T>::value);
    return -1;
  }
  void check_element_type(size_t element_size, int dtype_code) const;

  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
};

/// Element 0 of an f32 tensor on any device, copied to the host (waits for the device).
float item_f32(const Tensor& t);
/// Every element of an f32 tensor on any device, copied to the host.
std::vector<float> host_values_f32(const Tensor& t);

/// Throws unless every tensor is defined and on the same device; returns that device.
Device common_device(std::initializer_list<const Tensor*> tensors, const char* op);

}  // namespace octet
