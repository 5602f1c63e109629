// Private to the CUDA GEMM backend: the cuBLASLt status check, one cuBLASLt handle and one
// workspace per device, and counters that let tests observe the algorithm cache.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>

#include "octet/core/device.h"
#include "octet/core/error.h"

/// Throws octet::Error naming the cuBLAS status and the failed call.
#define OCTET_CHECK_CUBLAS(call)                                                      \
  do {                                                                                \
    cublasStatus_t octet_cublas_status_ = (call);                                     \
    if (octet_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                              \
      OCTET_ERROR("cuBLAS error ", cublasLtGetStatusName(octet_cublas_status_), " (", \
                  cublasLtGetStatusString(octet_cublas_status_), ") in ", #call);     \
    }                                                                                 \
  } while (false)

namespace octet::ops::cuda {

/// cuBLASLt workspace per device. 32 MiB is what the cuBLAS guide recommends for Hopper
/// (cublasSetWorkspace: "32 MiB for Hopper, 4 MiB otherwise"); PyTorch uses the same figure.
inline constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
/// cuBLASLt wants the workspace 256-byte aligned (TransformerEngine checks the same).
inline constexpr size_t kCublasWorkspaceAlignment = 256;

/// What every cuBLASLt call on a device needs.
struct CublasLt {
  cublasLtHandle_t handle = nullptr;  ///< created once under a DeviceGuard for the device
  void* workspace = nullptr;          ///< kCublasWorkspaceBytes, allocated once via device_alloc
  size_t workspace_bytes = 0;
};
/// The device's cuBLASLt handle and workspace, created on first use and kept for the process.
/// All GEMMs of a device run on octet's one stream for it, so they may share the workspace.
const CublasLt& cublaslt(const Device& device);

/// Entries in the GEMM algorithm cache (one per device, shape, dtypes, layouts, ... key).
size_t gemm_cache_size();
/// How many times the GEMM backend asked cuBLASLt for a heuristic since the process started.
uint64_t gemm_heuristic_queries();
/// How many MXFP8 GEMMs ran emulated (dequantize to BF16, then a BF16 GEMM).
uint64_t gemm_mxfp8_emulations();
/// How many GEMMs with an addend ran it as a separate pass because cuBLASLt declined C != D (its
/// heuristic found no such algorithm, or cublasLtMatmul refused one). FP32 operands with a BF16 D
/// always add it separately (cuBLASLt's FP32 GEMM writes FP32) and are not counted.
uint64_t gemm_unfused_addends();

}  // namespace octet::ops::cuda
