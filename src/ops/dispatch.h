// The one way every op entry point runs its backend: validate first (in the op's own file), then
// dispatch() under a DeviceGuard for the tensors' device and an NVTX range named after the op.
#pragma once

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "core/nvtx.h"
#include "octet/core/device.h"
#include "octet/core/profiler.h"
#include "octet/core/tensor.h"

/// Wraps a cuda:: call in a dispatcher's on_cuda branch, which dispatch() never reaches in a
/// build without CUDA.
#if OCTET_WITH_CUDA
#define OCTET_CUDA_ONLY(call) call
#else
#define OCTET_CUDA_ONLY(call)
#endif

namespace octet::ops {

/// The name an op is timed under: `op` alone, or, while the op profiler is on, `op` followed by
/// `details` (dtypes, shape), so that its table tells calls of one op apart.
template <typename... Details>
std::string op_label(const char* op, const Details&... details) {
  return profiler::enabled() ? detail::concat(op, " ", details...) : std::string(op);
}

/// Runs `on_cpu` or `on_cuda` for `device` under a device guard and an NVTX range named `op`,
/// timed by the op profiler when it is enabled.
/// Without the CUDA backend a GPU device gets a clear error, and `on_cuda` is never called (the
/// caller wraps the cuda:: call in #if OCTET_WITH_CUDA).
template <typename OnCpu, typename OnCuda>
void dispatch(const Device& device, const char* op, OnCpu&& on_cpu, OnCuda&& on_cuda) {
#if !OCTET_WITH_CUDA
  OCTET_CHECK(device.is_cpu(), op, ": tensors on ", device,
              " need the CUDA backend, but octet was built without CUDA");
#endif
  DeviceGuard guard(device);
  NvtxRange range(op);
  profiler::OpScope timer(device, op);
  if (device.is_cpu()) {
    on_cpu();
  } else {
    on_cuda();
  }
}

/// Throws unless `t` is defined with dtype f32 or bf16, naming `op` and `what`.
inline void check_float_activation(const Tensor& t, const char* op, const char* what) {
  OCTET_CHECK(t.defined(), op, ": ", what, " is an undefined tensor");
  OCTET_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, ": unsupported dtype for ",
              what, ": expected f32 or bf16, got ", t.describe());
  OCTET_CHECK(t.numel() > 0, op, ": ", what, " is an empty tensor (", t.describe(), ")");
}

/// Tensors with the names that error messages give them.
using NamedTensors = std::vector<std::pair<const Tensor*, std::string>>;

/// Throws unless every tensor is on the first one's device, naming the first that is not.
inline void check_same_device(const NamedTensors& tensors, const char* op) {
  const auto& [first, first_name] = tensors.front();
  for (const auto& [t, name] : tensors)
    OCTET_CHECK(t->device() == first->device(), op, ": all tensors must be on one device, got ",
                first_name, " ", first->describe(), " and ", name, " ", t->describe());
}

}  // namespace octet::ops
