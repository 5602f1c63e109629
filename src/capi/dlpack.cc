// DLPack tensors in and out of octet without copies, the error boundary, and the join with the
// caller's CUDA stream.
#include <memory>
#include <string>
#include <vector>

#include "capi/capi_internal.h"
#include "octet/core/device.h"

#if OCTET_WITH_CUDA
#include <cuda_runtime.h>

#include "octet/core/cuda_context.h"
#endif

namespace octet::capi {

namespace {

thread_local std::string last_error;

/// DLPack's code and bits for an octet dtype; FP8 codes and E8M0 scales travel as uint8
/// (DLPack 0.6 has no FP8 types).
DLDataType dl_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return {kDLFloat, 32, 1};
    case DType::bf16:
      return {kDLBfloat, 16, 1};
    case DType::f16:
      return {kDLFloat, 16, 1};
    case DType::e4m3:
    case DType::e5m2:
    case DType::e8m0:
    case DType::u8:
      return {kDLUInt, 8, 1};
    case DType::u16:
      return {kDLUInt, 16, 1};
    case DType::i32:
      return {kDLInt, 32, 1};
    case DType::i64:
      return {kDLInt, 64, 1};
  }
  OCTET_ERROR("no DLPack type for dtype ", dtype_name(dtype));
}

std::string dl_dtype_str(DLDataType t) {
  const char* code = t.code == kDLFloat    ? "float"
                     : t.code == kDLBfloat ? "bfloat"
                     : t.code == kDLInt    ? "int"
                     : t.code == kDLUInt   ? "uint"
                                           : "code";
  std::string s = std::string(code) + std::to_string(t.bits);
  if (t.code > kDLBfloat) s += " (DLPack code " + std::to_string(t.code) + ")";
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

DType from_dl_dtype(DLDataType t, const char* what) {
  const DType candidates[] = {DType::f32, DType::bf16, DType::f16, DType::u8,
                              DType::u16, DType::i32,  DType::i64};
  for (DType d : candidates) {
    const DLDataType dl = dl_dtype(d);
    if (dl.code == t.code && dl.bits == t.bits && t.lanes == 1) return d;
  }
  throw InvalidArgument(__FILE__, __LINE__,
                        detail::concat(what, ": unsupported DLPack dtype ", dl_dtype_str(t),
                                       " (expected float32, bfloat16, float16, uint8 or int)"));
}

/// The octet view of a DLTensor: validated device, dtype, shape and layout.
struct Checked {
  void* data;
  Device device;
  DType dtype;
  Shape shape;
};

Checked check(const DLTensor* t, const char* what) {
  OCTET_CAPI_CHECK(t != nullptr, what, " must not be NULL");
  OCTET_CAPI_CHECK(t->ndim >= 0 && (t->ndim == 0 || t->shape != nullptr), what,
                   ": expected a shape, got ndim ", t->ndim,
                   t->shape == nullptr ? " and no shape" : "");
  Checked c{nullptr, to_device(t->device), from_dl_dtype(t->dtype, what),
            Shape(t->shape, t->shape + t->ndim)};
  for (int64_t extent : c.shape)
    OCTET_CAPI_CHECK(extent >= 0, what, ": negative extent in shape ", shape_str(c.shape));
  if (t->strides != nullptr) {
    // Row-major and compact; the stride of an extent-1 dimension does not matter.
    int64_t expected = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
      OCTET_CAPI_CHECK(c.shape[i] == 1 || t->strides[i] == expected, what,
                       ": expected a contiguous row-major tensor, got shape ", shape_str(c.shape),
                       " with strides ", shape_str(Shape(t->strides, t->strides + t->ndim)),
                       " (octet never copies an input: make it contiguous first)");
      expected *= c.shape[i];
    }
  }
  c.data = static_cast<char*>(t->data) + t->byte_offset;
  const size_t element = dtype_size(c.dtype);
  OCTET_CAPI_CHECK(reinterpret_cast<uintptr_t>(c.data) % element == 0, what,
                   ": data is not aligned to its ", element, "-byte elements");
  OCTET_CAPI_CHECK(c.data != nullptr || shape_numel(c.shape) == 0, what, ": NULL data for shape ",
                   shape_str(c.shape));
  check_device_available(c.device);  // no device query after the first (the count is cached)
  return c;
}

struct Exported {
  DLManagedTensor managed{};
  Shape shape;
  std::shared_ptr<Storage> storage;
  void* stream = nullptr;
};

#if OCTET_WITH_CUDA
/// octet's stream on a device and this thread's event for joining it with a caller's stream.
struct JoinPoint {
  cudaStream_t octet = nullptr;
  cudaEvent_t event = nullptr;
};

/// This thread's join point on `device`, which must be the current device. Made on first use and
/// kept: octet's streams live as long as the process, so a call looks nothing up (no lock, no
/// device query). cudaStreamWaitEvent captures the event's state at the call, so recording it
/// again later is safe.
const JoinPoint& join_point(const Device& device) {
  thread_local std::vector<JoinPoint> points;
  if (static_cast<int>(points.size()) <= device.index) points.resize(device.index + 1);
  JoinPoint& p = points[device.index];
  if (p.event == nullptr) {
    p.octet = cuda::stream(device);
    OCTET_CHECK_CUDA(cudaEventCreateWithFlags(&p.event, cudaEventDisableTiming));
  }
  return p;
}

/// `waiter` waits for what `producer` has queued so far (both on the current device).
void stream_wait(cudaStream_t waiter, cudaStream_t producer, cudaEvent_t event) {
  if (waiter == producer) return;
  OCTET_CHECK_CUDA(cudaEventRecord(event, producer));
  OCTET_CHECK_CUDA(cudaStreamWaitEvent(waiter, event, 0));
}
#endif

void release_exported(DLManagedTensor* self) {
  auto* e = static_cast<Exported*>(self->manager_ctx);
#if OCTET_WITH_CUDA
  if (e->storage && e->storage->device().is_cuda()) {
    // The pool frees on octet's stream: order that after what the consumer queued on its stream.
    // A deleter cannot report a failure, so one is ignored (the free then is not ordered).
    try {
      const Device& d = e->storage->device();
      DeviceGuard guard(d);
      const JoinPoint& p = join_point(d);
      stream_wait(p.octet, static_cast<cudaStream_t>(e->stream), p.event);
    } catch (...) {
    }
  }
#endif
  delete e;
}

}  // namespace

void set_last_error(std::string message) { last_error = std::move(message); }

DType to_dtype(octet_dtype dtype, const char* what) {
  switch (dtype) {
    case OCTET_F32:
      return DType::f32;
    case OCTET_BF16:
      return DType::bf16;
    case OCTET_F16:
      return DType::f16;
    case OCTET_E4M3:
      return DType::e4m3;
    case OCTET_E5M2:
      return DType::e5m2;
    case OCTET_E8M0:
      return DType::e8m0;
  }
  throw InvalidArgument(__FILE__, __LINE__,
                        detail::concat(what, ": unknown octet_dtype ", static_cast<int>(dtype)));
}

octet_dtype from_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return OCTET_F32;
    case DType::bf16:
      return OCTET_BF16;
    case DType::f16:
      return OCTET_F16;
    case DType::e4m3:
      return OCTET_E4M3;
    case DType::e5m2:
      return OCTET_E5M2;
    case DType::e8m0:
      return OCTET_E8M0;
    default:
      OCTET_ERROR("dtype ", dtype_name(dtype), " has no octet_dtype");
  }
}

Device to_device(const DLDevice& device) {
  switch (device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
      return Device::cpu();  // pinned host memory is host memory
    case kDLCUDA:
      OCTET_CAPI_CHECK(device.device_id >= 0, "negative CUDA device ordinal ", device.device_id);
      return Device::cuda(device.device_id);
    default:
      throw InvalidArgument(
          __FILE__, __LINE__,
          detail::concat("unsupported DLPack device type ", static_cast<int>(device.device_type),
                         " (octet takes CPU (1) and CUDA (2) memory)"));
  }
}

DLDevice from_device(const Device& device) {
  return device.is_cpu() ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, device.index};
}

Tensor borrow(const DLTensor* t, const char* what) {
  Checked c = check(t, what);
  const size_t bytes = static_cast<size_t>(shape_numel(c.shape)) * dtype_size(c.dtype);
  return Tensor::adopt(std::make_shared<Storage>(c.data, bytes, c.device, [] {}), c.shape, c.dtype);
}

Tensor adopt(DLManagedTensor* t, const char* what) {
  OCTET_CAPI_CHECK(t != nullptr, what, " must not be NULL");
  auto release = [t] {
    if (t->deleter != nullptr) t->deleter(t);
  };
  Checked c{};
  try {
    c = check(&t->dl_tensor, what);
  } catch (...) {
    release();
    throw;
  }
  const size_t bytes = static_cast<size_t>(shape_numel(c.shape)) * dtype_size(c.dtype);
  std::shared_ptr<Storage> storage;
  try {
    storage = std::make_shared<Storage>(c.data, bytes, c.device, release);
  } catch (...) {
    release();
    throw;
  }
  return Tensor::adopt(std::move(storage), c.shape, c.dtype);
}

DLManagedTensor* export_tensor(const Tensor& t, void* stream) {
  auto e = std::make_unique<Exported>();
  e->shape = t.shape();
  e->storage = t.storage();
  e->stream = stream;
  DLTensor& dl = e->managed.dl_tensor;
  dl.data = t.numel() == 0 ? nullptr : t.raw_data();
  dl.device = from_device(t.device());
  dl.ndim = t.ndim();
  dl.dtype = dl_dtype(t.dtype());
  dl.shape = e->shape.data();
  dl.strides = nullptr;
  dl.byte_offset = 0;
  e->managed.manager_ctx = e.get();
  e->managed.deleter = release_exported;
  return &e.release()->managed;
}

StreamJoin::StreamJoin(const Device& device, void* stream) : stream_(stream) {
#if OCTET_WITH_CUDA
  if (!device.is_cuda()) return;
  guard_.emplace(device);
  const JoinPoint& p = join_point(device);
  octet_stream_ = p.octet;
  event_ = p.event;
  stream_wait(p.octet, static_cast<cudaStream_t>(stream_), p.event);
#endif
}

StreamJoin::~StreamJoin() {
#if OCTET_WITH_CUDA
  // A failed join cannot be reported from a destructor; the call's own error (if any) stands.
  if (!guard_) return;
  try {
    stream_wait(static_cast<cudaStream_t>(stream_), static_cast<cudaStream_t>(octet_stream_),
                static_cast<cudaEvent_t>(event_));
  } catch (...) {
  }
#endif
}

}  // namespace octet::capi

extern "C" const char* octet_last_error(void) { return octet::capi::last_error.c_str(); }
