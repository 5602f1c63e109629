// Unchecked typed pointers into a tensor's storage, for backend code (CPU loops, CUDA launchers)
// whose entry points already validated every dtype (the element type may be a storage type
// without a dtype mapping).
#pragma once

#include "octet/core/tensor.h"

namespace octet::ops {

template <typename T>
const T* in(const Tensor& t) {
  return static_cast<const T*>(t.raw_data());
}
template <typename T>
T* out(const Tensor& t) {
  return static_cast<T*>(t.raw_data());
}

}  // namespace octet::ops
