// Compiled only when OCTET_WITH_CUDA.
#include "octet/core/cuda_context.h"

#include <cstdint>
#include <mutex>
#include <vector>

namespace octet::cuda {
namespace {

struct PerDevice {
  cudaStream_t stream = nullptr;
  cudaDeviceProp props{};
};

// Created lazily per device; never destroyed (streams outlive static tensors at exit).
PerDevice& per_device(const Device& device) {
  static std::mutex mutex;
  static std::vector<PerDevice*> devices;
  OCTET_CHECK(device.is_cuda(), "expected a CUDA device, got ", device);
  std::lock_guard lock(mutex);
  if (devices.empty()) devices.resize(std::max(cuda_device_count(), 1), nullptr);
  check_device_available(device);
  PerDevice*& slot = devices[device.index];
  if (slot == nullptr) {
    DeviceGuard guard(device);
    auto* state = new PerDevice;
    OCTET_CHECK_CUDA(cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking));
    OCTET_CHECK_CUDA(cudaGetDeviceProperties(&state->props, device.index));
    // Keep freed blocks in the pool instead of returning them to the driver at every sync.
    cudaMemPool_t pool;
    OCTET_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, device.index));
    uint64_t threshold = UINT64_MAX;
    OCTET_CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    slot = state;
  }
  return *slot;
}

}  // namespace

cudaStream_t stream(const Device& device) { return per_device(device).stream; }
const cudaDeviceProp& properties(const Device& device) { return per_device(device).props; }

void synchronize(const Device& device) {
  DeviceGuard guard(device);
  OCTET_CHECK_CUDA(cudaStreamSynchronize(stream(device)));
}

}  // namespace octet::cuda
