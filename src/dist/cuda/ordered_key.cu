// The ordered-key transform of the NCCL communicator's MAX (src/dist/ordered_key.h), in place on
// the device.
#include <cuda_runtime.h>

#include <algorithm>

#include "dist/cuda/ordered_key_launch.h"
#include "dist/ordered_key.h"

namespace octet::dist::cuda {

// ----------------------------------------------------------------------------
// CUDA kernels

__global__ void to_ordered_keys_kernel(uint32_t* data, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = ordered_key(fp8::bits_float(data[i]));
  }
}

__global__ void from_ordered_keys_kernel(uint32_t* data, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = fp8::float_bits(from_ordered_key(data[i]));
  }
}

// ----------------------------------------------------------------------------
// kernel launchers

namespace {
// Enough blocks to fill a GPU for the few thousand amaxes this sees; the loops cover any n.
constexpr int kThreads = 256, kMaxBlocks = 1024;
int blocks_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads));
}
}  // namespace

void to_ordered_keys(void* data, int64_t n, cudaStream_t stream) {
  if (n > 0)
    to_ordered_keys_kernel<<<blocks_for(n), kThreads, 0, stream>>>(static_cast<uint32_t*>(data),
                                                                   n);
}

void from_ordered_keys(void* data, int64_t n, cudaStream_t stream) {
  if (n > 0)
    from_ordered_keys_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        static_cast<uint32_t*>(data), n);
}

}  // namespace octet::dist::cuda
