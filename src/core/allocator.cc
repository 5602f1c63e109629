#include "octet/core/allocator.h"

#include <malloc.h>    // malloc_usable_size (glibc): a host block's size at free
#include <sys/mman.h>  // madvise

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "octet/core/error.h"

#if OCTET_WITH_CUDA
#include "octet/core/cuda_context.h"
#endif

namespace octet {
namespace {
size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

/// Bytes of host tensor memory held now and the most held since the last reset: the CPU's
/// counterpart of the CUDA pool's used-memory high-water mark.
std::atomic<size_t> g_host_live{0};
std::atomic<size_t> g_host_peak{0};

/// device_allocations' counters: the host's, then one per GPU index (the last one shared by any
/// index past it).
constexpr size_t kCountedDevices = 1 + 64;
std::array<std::atomic<uint64_t>, kCountedDevices> g_allocations{};

std::atomic<uint64_t>& allocations_of(const Device& device) {
  const size_t slot = device.is_cpu() ? 0 : 1 + static_cast<size_t>(device.index);
  return g_allocations[std::min(slot, kCountedDevices - 1)];
}

/// A host block of `bytes` (kHostAlignment-aligned; huge-page backed when large). glibc maps
/// blocks above its mmap threshold fresh on every allocation, and with 4 KiB pages the first touch
/// of each page is a fault: a 512 MiB tensor takes 131,072 of them, where huge pages take 256.
void* host_alloc(size_t bytes) {
  if (bytes < kHostHugePageBytes)
    return std::aligned_alloc(kHostAlignment, round_up(bytes, kHostAlignment));
  const size_t size = round_up(bytes, kHostHugePageBytes);
  void* ptr = std::aligned_alloc(kHostHugePageBytes, size);
  // Advice only: where transparent huge pages are off, the block keeps 4 KiB pages.
  if (ptr != nullptr) madvise(ptr, size, MADV_HUGEPAGE);
  return ptr;
}

void add_host_bytes(size_t bytes) {
  const size_t live = g_host_live.fetch_add(bytes) + bytes;
  size_t peak = g_host_peak.load();
  while (live > peak && !g_host_peak.compare_exchange_weak(peak, live)) {
  }
}
}  // namespace

void* device_alloc(size_t bytes, const Device& device) {
  if (bytes == 0) bytes = 1;  // distinct non-null pointers keep empty-tensor handling uniform
  allocations_of(device).fetch_add(1, std::memory_order_relaxed);
  if (device.is_cpu()) {
    void* ptr = host_alloc(bytes);
    OCTET_CHECK(ptr != nullptr, "out of host memory allocating ", bytes, " bytes");
    add_host_bytes(malloc_usable_size(ptr));
    return ptr;
  }
#if OCTET_WITH_CUDA
  check_device_available(device);
  DeviceGuard guard(device);
  void* ptr = nullptr;
  cudaError_t status = cudaMallocAsync(&ptr, bytes, cuda::stream(device));
  if (status != cudaSuccess) {
    cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    throw OutOfMemoryError(__FILE__, __LINE__,
                           detail::concat("out of GPU memory on ", device, ": needed ", bytes,
                                          " bytes (", bytes / (1 << 20), " MiB) more with ",
                                          free_bytes / (1 << 20), " MiB free of ",
                                          total_bytes / (1 << 20), " MiB"));
  }
  return ptr;
#else
  OCTET_ERROR("cannot allocate on ", device, ": octet was built without CUDA");
#endif
}

void device_free(void* ptr, const Device& device) noexcept {
  if (ptr == nullptr) return;
  if (device.is_cpu()) {
    g_host_live.fetch_sub(malloc_usable_size(ptr));
    std::free(ptr);
    return;
  }
#if OCTET_WITH_CUDA
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device.index);
  cudaFreeAsync(ptr, cuda::stream(device));
  cudaSetDevice(previous);
#endif
}

uint64_t device_allocations(const Device& device) {
  return allocations_of(device).load(std::memory_order_relaxed);
}

size_t device_peak_bytes(const Device& device) {
  if (device.is_cpu()) return g_host_peak.load();
#if OCTET_WITH_CUDA
  cudaMemPool_t pool;
  OCTET_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, device.index));
  uint64_t high = 0;
  OCTET_CHECK_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
  return static_cast<size_t>(high);
#else
  return 0;
#endif
}

void reset_device_peak(const Device& device) {
  if (device.is_cpu()) {
    g_host_peak.store(g_host_live.load());
    return;
  }
#if OCTET_WITH_CUDA
  cudaMemPool_t pool;
  OCTET_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, device.index));
  uint64_t zero = 0;
  OCTET_CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
#endif
}

void copy_bytes(void* dst, const Device& dst_device, const void* src, const Device& src_device,
                size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if OCTET_WITH_CUDA
  if (dst_device.is_cuda() && src_device.is_cuda()) {
    if (dst_device.index == src_device.index) {  // ordered on the device's one stream
      DeviceGuard guard(dst_device);
      OCTET_CHECK_CUDA(
          cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda::stream(dst_device)));
      return;
    }
    // Between devices, ordered on both streams without a host wait: the destination's stream
    // waits for the source's pending work and copies; the source's stream then waits for the
    // copy, so the source's memory is neither rewritten nor reused (the pools are stream-ordered)
    // before it has been read.
    const cudaEvent_t written = cuda::record_event(src_device);
    cudaEvent_t read = nullptr;
    {
      DeviceGuard guard(dst_device);
      const cudaStream_t stream = cuda::stream(dst_device);
      OCTET_CHECK_CUDA(cudaStreamWaitEvent(stream, written, 0));
      OCTET_CHECK_CUDA(
          cudaMemcpyPeerAsync(dst, dst_device.index, src, src_device.index, bytes, stream));
      read = cuda::record_event(dst_device);
    }
    DeviceGuard guard(src_device);
    OCTET_CHECK_CUDA(cudaStreamWaitEvent(cuda::stream(src_device), read, 0));
    OCTET_CHECK_CUDA(cudaEventDestroy(written));  // released once complete
    OCTET_CHECK_CUDA(cudaEventDestroy(read));
    return;
  }
  const Device& gpu = dst_device.is_cuda() ? dst_device : src_device;
  DeviceGuard guard(gpu);
  OCTET_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda::stream(gpu)));
  cuda::synchronize(gpu);
#else
  OCTET_ERROR("cannot copy between ", src_device, " and ", dst_device,
              ": octet was built without CUDA");
#endif
}

void zero_bytes(void* ptr, const Device& device, size_t bytes) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    std::memset(ptr, 0, bytes);
    return;
  }
#if OCTET_WITH_CUDA
  DeviceGuard guard(device);
  OCTET_CHECK_CUDA(cudaMemsetAsync(ptr, 0, bytes, cuda::stream(device)));
#else
  OCTET_ERROR("cannot use ", device, ": octet was built without CUDA");
#endif
}

}  // namespace octet
