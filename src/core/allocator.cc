#include "octet/core/allocator.h"

#include <malloc.h>  // malloc_usable_size (glibc): a host block's size at free

#include <atomic>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

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

void add_host_bytes(size_t bytes) {
  const size_t live = g_host_live.fetch_add(bytes) + bytes;
  size_t peak = g_host_peak.load();
  while (live > peak && !g_host_peak.compare_exchange_weak(peak, live)) {
  }
}

#if OCTET_WITH_CUDA
/// Small CUDA blocks, freed, wait here for the next allocation of their size class on the same
/// device. cudaMallocAsync and cudaFreeAsync cost microseconds of host time a call, and an FP8
/// step makes a scale, an amax and their kin for every tensor it casts: hundreds of blocks of a
/// few bytes a step in an MoE model, whose expert GEMMs already keep the host busy. A reused
/// block is as safe as one the pool hands back: blocks are allocated and freed only on octet's
/// one stream per device, so work queued after the reuse runs after work queued before the free.
/// OCTET_SMALL_BLOCK_CACHE=0 turns the cache off (compute-sanitizer then sees every block at its
/// requested size, fresh from the pool).
class SmallBlockCache {
 public:
  static constexpr size_t kSmallestBlock = 256;
  static constexpr size_t kLargestBlock = size_t{64} << 10;
  /// Free blocks kept per device at most; more go back to the pool.
  static constexpr size_t kMaxCachedBytes = size_t{16} << 20;

  SmallBlockCache() {
    const char* env = std::getenv("OCTET_SMALL_BLOCK_CACHE");
    enabled_ = env == nullptr || std::strcmp(env, "0") != 0;
  }

  /// The bytes to ask the pool for: small requests are rounded up to their class's block size.
  size_t block_bytes(size_t bytes) const {
    return enabled_ && bytes <= kLargestBlock ? kSmallestBlock << size_class(bytes) : bytes;
  }

  /// A cached block of `bytes`' class on `device`, or nullptr.
  void* take(size_t bytes, int device) {
    if (!enabled_ || bytes > kLargestBlock) return nullptr;
    const std::lock_guard lock(mutex_);
    if (static_cast<size_t>(device) >= devices_.size()) return nullptr;
    PerDevice& cache = devices_[device];
    std::vector<void*>& blocks = cache.free[size_class(bytes)];
    if (blocks.empty()) return nullptr;
    void* ptr = blocks.back();
    blocks.pop_back();
    cache.bytes -= kSmallestBlock << size_class(bytes);
    return ptr;
  }

  /// Keeps a freed block of `bytes` (as requested); false when it is not small or the device's
  /// cache is full, and the block should go back to the pool.
  bool put(void* ptr, size_t bytes, int device) noexcept {
    if (!enabled_ || bytes > kLargestBlock) return false;
    const size_t block = kSmallestBlock << size_class(bytes);
    try {
      const std::lock_guard lock(mutex_);
      if (static_cast<size_t>(device) >= devices_.size()) devices_.resize(device + 1);
      PerDevice& cache = devices_[device];
      if (cache.bytes + block > kMaxCachedBytes) return false;
      cache.free[size_class(bytes)].push_back(ptr);
      cache.bytes += block;
      return true;
    } catch (...) {  // no memory for the list: the pool takes the block
      return false;
    }
  }

  /// Every cached block of `device`, emptied out of the cache (to free when memory runs short).
  std::vector<void*> drain(int device) {
    std::vector<void*> out;
    const std::lock_guard lock(mutex_);
    if (static_cast<size_t>(device) >= devices_.size()) return out;
    for (std::vector<void*>& blocks : devices_[device].free) {
      out.insert(out.end(), blocks.begin(), blocks.end());
      blocks.clear();
    }
    devices_[device].bytes = 0;
    return out;
  }

 private:
  static constexpr int kClasses = std::countr_zero(kLargestBlock / kSmallestBlock) + 1;
  /// 0 for up to 256 bytes, 1 for up to 512, ..., kClasses - 1 for up to kLargestBlock.
  static int size_class(size_t bytes) {
    return bytes <= kSmallestBlock ? 0 : std::bit_width((bytes - 1) / kSmallestBlock);
  }
  struct PerDevice {
    std::vector<void*> free[kClasses];
    size_t bytes = 0;
  };
  bool enabled_ = true;
  std::mutex mutex_;
  std::vector<PerDevice> devices_;
};

/// Never destroyed: tensors in static storage may be freed after any static destructor ran.
SmallBlockCache& small_blocks() {
  static auto* cache = new SmallBlockCache;
  return *cache;
}
#endif
}  // namespace

void* device_alloc(size_t bytes, const Device& device) {
  if (bytes == 0) bytes = 1;  // distinct non-null pointers keep empty-tensor handling uniform
  if (device.is_cpu()) {
    void* ptr = std::aligned_alloc(kHostAlignment, round_up(bytes, kHostAlignment));
    OCTET_CHECK(ptr != nullptr, "out of host memory allocating ", bytes, " bytes");
    add_host_bytes(malloc_usable_size(ptr));
    return ptr;
  }
#if OCTET_WITH_CUDA
  check_device_available(device);
  SmallBlockCache& cache = small_blocks();
  if (void* cached = cache.take(bytes, device.index)) return cached;
  DeviceGuard guard(device);
  void* ptr = nullptr;
  const size_t block = cache.block_bytes(bytes);
  cudaError_t status = cudaMallocAsync(&ptr, block, cuda::stream(device));
  if (status != cudaSuccess) {  // the cached small blocks back to the pool, then once more
    cudaGetLastError();
    std::vector<void*> cached = cache.drain(device.index);
    for (void* p : cached) cudaFreeAsync(p, cuda::stream(device));
    if (!cached.empty()) status = cudaMallocAsync(&ptr, block, cuda::stream(device));
  }
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

void device_free(void* ptr, size_t bytes, const Device& device) noexcept {
  if (ptr == nullptr) return;
  if (device.is_cpu()) {
    g_host_live.fetch_sub(malloc_usable_size(ptr));
    std::free(ptr);
    return;
  }
#if OCTET_WITH_CUDA
  if (small_blocks().put(ptr, bytes, device.index)) return;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device.index);
  cudaFreeAsync(ptr, cuda::stream(device));
  cudaSetDevice(previous);
#endif
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
