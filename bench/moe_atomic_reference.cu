// The float-atomic dprob reduction of moe_atomic_reference.h: the pattern that made another
// engine's MoE training silently non-reproducible. Measurement only; never part of liboctet.
#include "moe_atomic_reference.h"

#include <cstdint>

#include "octet/core/cuda_context.h"
#include "ops/activation_math.h"

namespace octet::bench {
namespace {

constexpr int kThreads = 128;
/// Columns per CTA: 16 CTAs (and 16 atomic adds) per row at ffn 2048.
constexpr int kChunk = 128;

__global__ void atomic_dprob_kernel(const uint16_t* dh, const uint16_t* fc1, int64_t f,
                                    float* dprob) {
  __shared__ float partial[kThreads];
  const int64_t r = blockIdx.y;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x;
  float v = 0.0f;
  if (j < f) {
    const float gate = ops::math::to_float(fc1[r * 2 * f + j]);
    const float up = ops::math::to_float(fc1[r * 2 * f + f + j]);
    v = ops::math::to_float(dh[r * f + j]) * ops::math::swiglu(gate, up);
  }
  partial[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(dprob + r, partial[0]);  // the non-determinism, on purpose
}

}  // namespace

void atomic_reference_dprob(const Tensor& dh, const Tensor& fc1, const Tensor& dprob,
                            cudaStream_t stream) {
  static_assert(kChunk == kThreads, "one column per thread");
  const int64_t rows = dh.rows(), f = dh.cols();
  OCTET_CHECK_CUDA(cudaMemsetAsync(dprob.raw_data(), 0, dprob.nbytes(), stream));
  // A row's CTAs are neighbours in launch order, so they run at once on different SMs and their
  // atomics race, as in a fused kernel whose tiles of one row are adjacent. With the row as the
  // fast grid index a row's CTAs ran a wave apart, in launch order, and the sums came out the
  // same on every run (docs/DETERMINISM.md).
  OCTET_CHECK(rows <= 65535, "atomic_reference_dprob: at most 65535 rows (grid y), got ", rows);
  const dim3 grid(static_cast<unsigned>((f + kChunk - 1) / kChunk), static_cast<unsigned>(rows));
  atomic_dprob_kernel<<<grid, kThreads, 0, stream>>>(
      static_cast<const uint16_t*>(dh.raw_data()), static_cast<const uint16_t*>(fc1.raw_data()), f,
      static_cast<float*>(dprob.raw_data()));
  OCTET_CHECK_LAUNCH();
}

}  // namespace octet::bench
