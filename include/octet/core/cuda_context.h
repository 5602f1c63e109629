// Per-device CUDA resources: octet's stream and properties. Only CUDA code includes this.
#pragma once

#include <cuda_runtime.h>

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

}  // namespace octet::cuda

/// Throws octet::Error naming the CUDA error and the failed call.
#define OCTET_CHECK_CUDA(call)                                                            \
  do {                                                                                    \
    cudaError_t octet_status_ = (call);                                                   \
    if (octet_status_ != cudaSuccess) {                                                   \
      OCTET_ERROR("CUDA error ", cudaGetErrorName(octet_status_), " (",                   \
                  cudaGetErrorString(octet_status_), ") in ", #call);                     \
    }                                                                                     \
  } while (false)

/// After every kernel launch: surfaces launch-configuration errors at the launch site.
#define OCTET_CHECK_LAUNCH() OCTET_CHECK_CUDA(cudaGetLastError())
