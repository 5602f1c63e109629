// Compiled only when OCTET_WITH_CUDA.
#include "octet/core/cuda_context.h"

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

namespace octet::cuda {
namespace {

struct PerDevice {
  cudaStream_t stream = nullptr;
  cudaDeviceProp props{};
};

/// Slots for device indices below this are read without a lock once made; a larger index takes
/// the locked path every time (no machine has that many GPUs).
constexpr int kFastDevices = 64;

PerDevice* make_per_device(const Device& device) {
  DeviceGuard guard(device);
  auto* state = new PerDevice;
  OCTET_CHECK_CUDA(cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking));
  OCTET_CHECK_CUDA(cudaGetDeviceProperties(&state->props, device.index));
  // Keep freed blocks in the pool instead of returning them to the driver at every sync.
  cudaMemPool_t pool;
  OCTET_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, device.index));
  uint64_t threshold = UINT64_MAX;
  OCTET_CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  return state;
}

// Created lazily per device; never destroyed (streams outlive static tensors at exit). Every op
// looks its device up here, so a made slot is read with one atomic load: no lock, no device query
// (the device was checked when its slot was made).
PerDevice& per_device(const Device& device) {
  static std::atomic<PerDevice*> fast[kFastDevices];
  if (device.is_cuda() && device.index >= 0 && device.index < kFastDevices) {
    if (PerDevice* made = fast[device.index].load(std::memory_order_acquire)) return *made;
  }
  static std::mutex mutex;
  static std::vector<PerDevice*> devices;
  OCTET_CHECK(device.is_cuda(), "expected a CUDA device, got ", device);
  std::lock_guard lock(mutex);
  if (devices.empty()) devices.resize(std::max(cuda_device_count(), 1), nullptr);
  check_device_available(device);
  PerDevice*& slot = devices[device.index];
  if (slot == nullptr) {
    slot = make_per_device(device);
    if (device.index < kFastDevices) fast[device.index].store(slot, std::memory_order_release);
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

cudaEvent_t record_event(const Device& device) {
  DeviceGuard guard(device);
  cudaEvent_t event = nullptr;
  OCTET_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  OCTET_CHECK_CUDA(cudaEventRecord(event, stream(device)));
  return event;
}

}  // namespace octet::cuda
