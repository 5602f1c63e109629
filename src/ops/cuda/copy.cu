// CUDA backend of the copy family: every pair of the list in one launch (a few when the list
// outgrows one launch's parameters), the list passed by value as a __grid_constant__ parameter,
// so there is no descriptor table to upload and nothing waits for the host.
#include <cuda_runtime.h>

#include <cstdint>

#include "octet/core/cuda_context.h"
#include "ops/copy_backend.h"
#include "ops/cuda/launch_util.cuh"

namespace octet::ops::cuda {
namespace {

/// Threads per CTA of the copy kernel.
constexpr int kCopyThreads = 256;
// Whole 16-byte sweeps of the CTA, so every chunk starts as aligned as its tensor.
static_assert(kCopyChunkBytes % (16 * kCopyThreads) == 0, "a chunk must be whole sweeps");
/// A batch of pairs, passed by value. Pair j owns the CTAs [first_chunk[j], first_chunk[j + 1])
/// of the launch, one per kCopyChunkBytes of its bytes.
struct CopyBatch {
  const uint8_t* src[kCopyMaxPairsPerLaunch];
  uint8_t* dst[kCopyMaxPairsPerLaunch];
  int64_t bytes[kCopyMaxPairsPerLaunch];
  int32_t first_chunk[kCopyMaxPairsPerLaunch + 1];
  int count;
};
static_assert(sizeof(CopyBatch) <= kMaxKernelParamBytes,
              "the copy kernel's parameters exceed the launch limit");

// ----------------------------------------------------------------------------
// CUDA kernels

/// Copies n bytes in Words (both addresses aligned to one), then the tail bytes.
template <typename Word>
__device__ __forceinline__ void copy_words(const uint8_t* __restrict__ src,
                                           uint8_t* __restrict__ dst, int n) {
  const int words = n / static_cast<int>(sizeof(Word));
  const Word* __restrict__ from = reinterpret_cast<const Word*>(src);
  Word* __restrict__ to = reinterpret_cast<Word*>(dst);
#pragma unroll 4
  for (int i = threadIdx.x; i < words; i += kCopyThreads) to[i] = from[i];
  for (int i = words * static_cast<int>(sizeof(Word)) + threadIdx.x; i < n; i += kCopyThreads)
    dst[i] = src[i];
}

/// One CTA per chunk of kCopyChunkBytes of one pair, so large and small tensors share one grid.
/// Each chunk moves the widest words both of its addresses are aligned to: 16 bytes for whole
/// tensors (CUDA allocations are 256-byte aligned), narrower for unaligned slices.
__global__ void __launch_bounds__(kCopyThreads)
    copy_tensors_kernel(const __grid_constant__ CopyBatch batch) {
  const int chunk = static_cast<int>(blockIdx.x);
  const int j = owning_entry(batch.first_chunk, batch.count, chunk);
  const int64_t begin = static_cast<int64_t>(chunk - batch.first_chunk[j]) * kCopyChunkBytes;
  const int n = static_cast<int>(min(kCopyChunkBytes, batch.bytes[j] - begin));
  const uint8_t* src = batch.src[j] + begin;
  uint8_t* dst = batch.dst[j] + begin;
  const uintptr_t misaligned =
      (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16;
  if (misaligned == 0) {  // every branch is uniform over the CTA
    copy_words<uint4>(src, dst, n);
  } else if (misaligned % 8 == 0) {
    copy_words<uint2>(src, dst, n);
  } else if (misaligned % 4 == 0) {
    copy_words<uint32_t>(src, dst, n);
  } else if (misaligned % 2 == 0) {
    copy_words<uint16_t>(src, dst, n);
  } else {
    copy_words<uint8_t>(src, dst, n);
  }
}

void launch(const CopyBatch& batch, cudaStream_t stream) {
  if (batch.count == 0) return;
  copy_tensors_kernel<<<static_cast<unsigned>(batch.first_chunk[batch.count]), kCopyThreads, 0,
                        stream>>>(batch);
  OCTET_CHECK_LAUNCH();
}

}  // namespace

// ----------------------------------------------------------------------------
// kernel launchers

void copy_tensors(std::span<const Tensor> src, std::span<const Tensor> dst) {
  const Device& device = src[0].device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  CopyBatch batch{};
  for (size_t i = 0; i < src.size(); ++i) {
    const int64_t bytes = static_cast<int64_t>(src[i].nbytes());
    if (bytes == 0) continue;  // no CTA: first_chunk must strictly increase
    const int64_t chunks = ceil_div(bytes, kCopyChunkBytes);
    OCTET_CHECK(chunks <= INT32_MAX, "copy_tensors: src[", i, "] (", src[i].describe(),
                ") exceeds the grid limit of one launch");
    if (batch.count == kCopyMaxPairsPerLaunch ||
        batch.first_chunk[batch.count] + chunks > INT32_MAX) {
      launch(batch, stream);
      batch.count = 0;
    }
    const int j = batch.count++;
    batch.src[j] = static_cast<const uint8_t*>(src[i].raw_data());
    batch.dst[j] = static_cast<uint8_t*>(dst[i].raw_data());
    batch.bytes[j] = bytes;
    batch.first_chunk[j + 1] = static_cast<int32_t>(batch.first_chunk[j] + chunks);
  }
  launch(batch, stream);
}

}  // namespace octet::ops::cuda
