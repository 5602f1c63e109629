// Launchers of src/dist/cuda/ordered_key.cu: f32 values to and from their ordered keys
// (dist/ordered_key.h), in place, on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace octet::dist::cuda {

void to_ordered_keys(void* data, int64_t n, cudaStream_t stream);
void from_ordered_keys(void* data, int64_t n, cudaStream_t stream);

}  // namespace octet::dist::cuda
