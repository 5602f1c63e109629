// CUDA backend of the optimizer family. global_norm_squared reduces in the fixed order of
// optimizer_backend.h (per-chunk partials, per-tensor sums of the partials, tensors in the given
// order), with no float atomics; adamw_step runs optimizer_math.h's scalar step. Both equal the
// CPU reference bit for bit, and neither synchronises with the host (the clip factor is read from
// norm_sq on the device).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "octet/core/cuda_context.h"
#include "ops/fixed_order_reduce.h"
#include "ops/optimizer_backend.h"

namespace octet::ops::cuda {
namespace {

/// Threads per block of the element-wise AdamW kernel.
constexpr int kAdamWThreads = 256;
/// Tensors described per launch of the norm kernels. The batch travels as a kernel parameter
/// (about 0.8 KB, well under the 4 KB every CUDA version accepts), so no descriptor table has to
/// be copied to the device.
constexpr int kMaxTensorsPerLaunch = 32;

/// A batch of gradient tensors for the norm kernels. Chunk indices are global over all tensors
/// of the call: tensor j owns partials [first_chunk[j], first_chunk[j + 1]).
struct NormBatch {
  const float* data[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  int64_t first_chunk[kMaxTensorsPerLaunch + 1];
  int count;
  int first_tensor;  ///< index of data[0] among all tensors of the call
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ----------------------------------------------------------------------------
// CUDA kernels

/// One CTA per chunk: partials[chunk] = fixed-order sum of double(g)^2 over the chunk.
__global__ void __launch_bounds__(kNormLanes)
    norm_chunk_partials_kernel(NormBatch batch, double* __restrict__ partials) {
  __shared__ double shared[kNormLanes];
  const int64_t chunk = batch.first_chunk[0] + blockIdx.x;
  int j = 0;
  while (chunk >= batch.first_chunk[j + 1]) ++j;
  const int64_t begin = (chunk - batch.first_chunk[j]) * kNormChunk;
  const float* __restrict__ x = batch.data[j] + begin;
  const int64_t n = min(kNormChunk, batch.numel[j] - begin);
  const double sum = fixed_order_reduce_block<kNormLanes, double>(
      n, SumOp{},
      [x](int64_t i) {
        const double value = x[i];
        return value * value;  // exact in double, so a contracted fma rounds the same
      },
      shared);
  if (threadIdx.x == 0) partials[chunk] = sum;
}

/// One CTA per tensor: tensor_sums[tensor] = fixed-order sum of the tensor's chunk partials.
__global__ void __launch_bounds__(kNormLanes)
    norm_tensor_sums_kernel(NormBatch batch, const double* __restrict__ partials,
                            double* __restrict__ tensor_sums) {
  __shared__ double shared[kNormLanes];
  const int j = blockIdx.x;
  const double* __restrict__ own = partials + batch.first_chunk[j];
  const int64_t chunks = batch.first_chunk[j + 1] - batch.first_chunk[j];
  const double sum = fixed_order_reduce_block<kNormLanes, double>(
      chunks, SumOp{}, [own](int64_t i) { return own[i]; }, shared);
  if (threadIdx.x == 0) tensor_sums[batch.first_tensor + j] = sum;
}

/// One thread: the tensor sums in the given order, rounded once to f32.
__global__ void norm_total_kernel(const double* __restrict__ tensor_sums, int count,
                                  float* __restrict__ norm_sq) {
  double total = 0.0;
  for (int i = 0; i < count; ++i) total += tensor_sums[i];
  norm_sq[0] = static_cast<float>(total);
}

/// One thread per element. Every thread derives the clip factor from norm_sq itself (a broadcast
/// load), so the host never waits for the norm.
__global__ void adamw_kernel(float* __restrict__ param, const float* __restrict__ grad,
                             float* __restrict__ m, float* __restrict__ v,
                             const float* __restrict__ norm_sq, AdamWCoefficients c, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float clip = adamw_clip_factor(norm_sq[0], c.max_grad_norm);
  float p = param[i], mi = m[i], vi = v[i];
  adamw_update(p, grad[i], mi, vi, c, clip);
  param[i] = p;
  m[i] = mi;
  v[i] = vi;
}

}  // namespace

// ----------------------------------------------------------------------------
// kernel launchers

void global_norm_squared(const Tensor* grads, int count, const Tensor& norm_sq) {
  const Device& device = norm_sq.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);

  int64_t total_chunks = 0;
  for (int i = 0; i < count; ++i) total_chunks += ceil_div(grads[i].numel(), kNormChunk);
  // Stream-ordered workspaces of 8-byte slots holding doubles (octet has no f64 dtype).
  Tensor partials = Tensor::empty({total_chunks}, DType::i64, device);
  Tensor tensor_sums = Tensor::empty({count}, DType::i64, device);
  auto* partials_data = static_cast<double*>(partials.raw_data());
  auto* tensor_sums_data = static_cast<double*>(tensor_sums.raw_data());

  int64_t next_chunk = 0;
  for (int first = 0; first < count; first += kMaxTensorsPerLaunch) {
    NormBatch batch{};
    batch.count = std::min(kMaxTensorsPerLaunch, count - first);
    batch.first_tensor = first;
    batch.first_chunk[0] = next_chunk;
    for (int j = 0; j < batch.count; ++j) {
      const Tensor& g = grads[first + j];
      batch.data[j] = g.data<float>();
      batch.numel[j] = g.numel();
      batch.first_chunk[j + 1] = batch.first_chunk[j] + ceil_div(g.numel(), kNormChunk);
    }
    const int64_t chunks = batch.first_chunk[batch.count] - next_chunk;
    OCTET_CHECK(chunks <= INT32_MAX, "global_norm_squared: ", chunks,
                " chunks in one launch exceed the grid limit");
    norm_chunk_partials_kernel<<<static_cast<unsigned>(chunks), kNormLanes, 0, stream>>>(
        batch, partials_data);
    OCTET_CHECK_LAUNCH();
    norm_tensor_sums_kernel<<<batch.count, kNormLanes, 0, stream>>>(batch, partials_data,
                                                                    tensor_sums_data);
    OCTET_CHECK_LAUNCH();
    next_chunk = batch.first_chunk[batch.count];
  }
  norm_total_kernel<<<1, 1, 0, stream>>>(tensor_sums_data, count, norm_sq.data<float>());
  OCTET_CHECK_LAUNCH();
}

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const Tensor& norm_sq, const AdamWCoefficients& coefficients) {
  const Device& device = param.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const int64_t n = param.numel();
  const int64_t blocks = ceil_div(n, kAdamWThreads);
  OCTET_CHECK(blocks <= INT32_MAX, "adamw_step: ", n, " elements exceed the 1-D grid limit");
  adamw_kernel<<<static_cast<unsigned>(blocks), kAdamWThreads, 0, stream>>>(
      param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(),
      norm_sq.data<float>(), coefficients, n);
  OCTET_CHECK_LAUNCH();
}

}  // namespace octet::ops::cuda
