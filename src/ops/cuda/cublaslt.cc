// Compiled only when OCTET_WITH_CUDA.
#include "ops/cuda/cublaslt.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "octet/core/allocator.h"
#include "octet/core/cuda_context.h"

namespace octet::ops::cuda {

// Created lazily per device and never destroyed: the handle and the workspace live as long as
// the process, like octet's streams (destroying them at exit would race with static tensors).
const CublasLt& cublaslt(const Device& device) {
  static std::mutex mutex;
  static std::vector<CublasLt*> devices;
  OCTET_CHECK(device.is_cuda(), "cuBLASLt needs a CUDA device, got ", device);
  std::lock_guard lock(mutex);
  if (devices.empty()) devices.resize(std::max(cuda_device_count(), 1), nullptr);
  check_device_available(device);
  CublasLt*& slot = devices[device.index];
  if (slot == nullptr) {
    DeviceGuard guard(device);
    auto state = std::make_unique<CublasLt>();
    // Over-allocate so the start can be rounded up to the alignment cuBLASLt expects.
    void* raw = device_alloc(kCublasWorkspaceBytes + kCublasWorkspaceAlignment, device);
    const auto address = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (address + kCublasWorkspaceAlignment - 1) /
                              kCublasWorkspaceAlignment * kCublasWorkspaceAlignment;
    state->workspace = reinterpret_cast<void*>(aligned);
    state->workspace_bytes = kCublasWorkspaceBytes;
    const cublasStatus_t status = cublasLtCreate(&state->handle);
    if (status != CUBLAS_STATUS_SUCCESS) device_free(raw, device);
    OCTET_CHECK_CUBLAS(status);
    slot = state.release();
  }
  return *slot;
}

}  // namespace octet::ops::cuda
