// Raw memory for tensors: aligned host memory, or the per-device stream-ordered CUDA pool.
#pragma once

#include <cstddef>
#include <cstdint>

#include "octet/core/device.h"

namespace octet {

/// Host allocations are aligned to this many bytes (one cache line; also wide enough for AVX-512
/// loads and for cudaMemcpy fast paths).
inline constexpr size_t kHostAlignment = 64;
/// Host blocks of at least this many bytes start on, and are sized in, transparent huge pages
/// (2 MiB on x86-64 and on 4 KiB-page arm64), and are advised to be backed by them.
inline constexpr size_t kHostHugePageBytes = size_t{2} << 20;

/// Allocates `bytes` on `device`. CUDA memory comes from the device's default memory pool
/// (cudaMallocAsync on octet's stream for that device), so freed blocks are reused without a
/// caching allocator of our own. Throws octet::Error on failure, naming the size.
void* device_alloc(size_t bytes, const Device& device);
/// Frees memory from device_alloc. Never throws.
void device_free(void* ptr, const Device& device) noexcept;

/// How many allocations device_alloc has made on `device` since the process started (all host
/// devices together for the CPU). On a GPU each costs host time (a cudaMallocAsync, then a
/// cudaFreeAsync), which a host-bound training step pays in full: `octet bench train` reports the
/// count a step.
uint64_t device_allocations(const Device& device);

/// Most bytes held at once since the last reset: in `device`'s CUDA memory pool, or for the CPU
/// in host tensor memory (all host devices together, as malloc counts the blocks).
size_t device_peak_bytes(const Device& device);
/// Starts a new peak measurement for `device` from what is held now.
void reset_device_peak(const Device& device);

/// Copies `bytes` between any two devices. A copy to or from the host waits for the copy to
/// finish; one between GPU memory is ordered on octet's streams instead (after the work queued
/// on both devices, before the work queued next on either) and returns at once.
void copy_bytes(void* dst, const Device& dst_device, const void* src, const Device& src_device,
                size_t bytes);
/// Sets `bytes` to zero on `device` (stream-ordered on octet's stream for CUDA).
void zero_bytes(void* ptr, const Device& device, size_t bytes);

}  // namespace octet
