// Per-device CUDA resources: octet's stream and properties. Only CUDA code includes this.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "octet/core/device.h"
#include "octet/core/error.h"

namespace octet::cuda {

/// octet's stream for `device` (one per device, created on first use, non-blocking). Every op on
/// that device runs on it, so ops on one device are ordered without events.
cudaStream_t stream(const Device& device);
/// Properties of the GPU behind `device` (cached).
const cudaDeviceProp& properties(const Device& device);
/// Waits for all of octet's work on `device`.
void synchronize(const Device& device);
/// A new event (no timing) recorded now on octet's stream for `device`; the caller destroys it.
cudaEvent_t record_event(const Device& device);

/// One bit per device, for per-device setup done once (a kernel's opt-in to more than 48 KiB of
/// dynamic shared memory: cudaFuncSetAttribute applies to the current device). A launch site keeps
/// a static one; two threads racing on it only repeat the same setup. Devices past index 63 are
/// never marked, so their setup simply runs every time.
class PerDeviceFlag {
 public:
  bool test(const Device& device) const {
    return bit(device) != 0 && (bits_.load(std::memory_order_relaxed) & bit(device)) != 0;
  }
  void set(const Device& device) { bits_.fetch_or(bit(device), std::memory_order_relaxed); }

 private:
  static uint64_t bit(const Device& device) {
    return device.index >= 0 && device.index < 64 ? uint64_t{1} << device.index : 0;
  }
  std::atomic<uint64_t> bits_{0};
};

}  // namespace octet::cuda

/// Throws octet::Error naming the CUDA error and the failed call.
#define OCTET_CHECK_CUDA(call)                                          \
  do {                                                                  \
    cudaError_t octet_status_ = (call);                                 \
    if (octet_status_ != cudaSuccess) {                                 \
      OCTET_ERROR("CUDA error ", cudaGetErrorName(octet_status_), " (", \
                  cudaGetErrorString(octet_status_), ") in ", #call);   \
    }                                                                   \
  } while (false)

/// After every kernel launch: surfaces launch-configuration errors at the launch site.
#define OCTET_CHECK_LAUNCH() OCTET_CHECK_CUDA(cudaGetLastError())
