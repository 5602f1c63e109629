// CUDA backend of the optimizer family. global_norm_squared reduces in the fixed order of
// optimizer_backend.h (per-chunk partials, per-tensor sums of the partials, tensors in the given
// order), with no float atomics; adamw_step runs optimizer_math.h's scalar step over all tensors
// without a cast in one launch, and over the tensors with an FP8 cast as the source of the tile
// quantizer (quantize_tile.cuh), which writes both copies from the updated values in the same pass.
// Both equal the CPU reference bit for bit, and neither synchronises with the host (the clip
// factor is read from norm_sq on the device) nor allocates for the step.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "octet/core/cuda_context.h"
#include "ops/cuda/fp8_kernels.cuh"
#include "ops/cuda/launch_util.cuh"
#include "ops/cuda/quantize_tile.cuh"
#include "ops/fixed_order_reduce.h"
#include "ops/optimizer_backend.h"

namespace octet::ops::cuda {
namespace {

/// Threads per block of the element-wise AdamW kernel.
constexpr int kAdamWThreads = 256;
/// Tensors per launch of the AdamW kernel: as many as fit in the parameters (56 bytes each with
/// the bf16 copy's pointer).
constexpr int kAdamWMaxTensors = 580;
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

/// A batch of tensors without an FP8 cast for the AdamW kernel, passed by value as a
/// __grid_constant__ parameter (no descriptor table to allocate and upload, so a step stays free
/// of host copies). Tensor j owns the CTAs [first_chunk[j], first_chunk[j + 1]) of the launch,
/// one per kAdamWChunk elements.
struct AdamWBatch {
  float* param[kAdamWMaxTensors];
  const float* grad[kAdamWMaxTensors];
  float* m[kAdamWMaxTensors];
  float* v[kAdamWMaxTensors];
  int64_t numel[kAdamWMaxTensors];
  float weight_decay[kAdamWMaxTensors];
  /// The bf16 copy of the updated tensor (AdamWTensor::bf16_copy), or nullptr.
  uint16_t* bf16[kAdamWMaxTensors];
  int32_t first_chunk[kAdamWMaxTensors + 1];
  int count;
};
// The kernel's parameters lie in order, each at its alignment; AdamWBatch's size is a multiple of
// its 8-byte alignment, so nothing pads between the three.
static_assert(sizeof(AdamWBatch) + sizeof(const float*) + sizeof(AdamWCoefficients) <=
                  kMaxKernelParamBytes,
              "the AdamW kernel's parameters exceed the launch limit");

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

/// The step on four consecutive elements.
__device__ __forceinline__ void adamw_update4(float4& p, const float4& g, float4& m, float4& v,
                                              const AdamWCoefficients& c, float weight_decay,
                                              float clip) {
  adamw_update(p.x, g.x, m.x, v.x, c, weight_decay, clip);
  adamw_update(p.y, g.y, m.y, v.y, c, weight_decay, clip);
  adamw_update(p.z, g.z, m.z, v.z, c, weight_decay, clip);
  adamw_update(p.w, g.w, m.w, v.w, c, weight_decay, clip);
}

/// The bf16 copy a chunk writes with its update (nothing when `out` is null), rounded as
/// ops::cast rounds.
struct Bf16Chunk {
  uint16_t* out = nullptr;

  __device__ void put(int64_t i, float value) const {
    if (out != nullptr) out[i] = fp8::encode_bf16(value);
  }
  /// Four values at i (a multiple of 4, `out` 8-byte aligned): one 8-byte store.
  __device__ void put4(int64_t i, const float4& p) const {
    if (out == nullptr) return;
    const uint2 packed = {fp8::encode_bf16x2(p.x, p.y), fp8::encode_bf16x2(p.z, p.w)};
    *reinterpret_cast<uint2*>(out + i) = packed;
  }
};

/// One CTA per chunk of kAdamWChunk elements of one tensor, so large and small tensors share one
/// grid. Every thread derives the clip factor from norm_sq itself (a broadcast load), so the host
/// never waits for the norm. A tensor with a bf16 copy gets its updated values rounded to bf16.
__global__ void __launch_bounds__(kAdamWThreads)
    adamw_multi_tensor_kernel(const __grid_constant__ AdamWBatch batch,
                              const float* __restrict__ norm_sq, const AdamWCoefficients c) {
  const int chunk = static_cast<int>(blockIdx.x);
  const int j = owning_entry(batch.first_chunk, batch.count, chunk);
  const int64_t begin = static_cast<int64_t>(chunk - batch.first_chunk[j]) * kAdamWChunk;
  const int n = static_cast<int>(min(kAdamWChunk, batch.numel[j] - begin));
  float* __restrict__ param = batch.param[j] + begin;
  const float* __restrict__ grad = batch.grad[j] + begin;
  float* __restrict__ m = batch.m[j] + begin;
  float* __restrict__ v = batch.v[j] + begin;
  const float weight_decay = batch.weight_decay[j];
  const float clip = adamw_clip_factor(norm_sq[0], c.max_grad_norm);
  Bf16Chunk copy;
  if (batch.bf16[j] != nullptr) copy.out = batch.bf16[j] + begin;

  // float4 accesses when all four tensors are 16-byte aligned (a chunk starts at a multiple of 4
  // elements, so it is aligned when its tensor is) and the copy 8-byte aligned; the order of
  // elements does not matter, since each is updated on its own.
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(param) |
                              reinterpret_cast<uintptr_t>(grad) | reinterpret_cast<uintptr_t>(m) |
                              reinterpret_cast<uintptr_t>(v) |
                              2 * reinterpret_cast<uintptr_t>(copy.out);
  const int vectors = addresses % alignof(float4) == 0 ? n / 4 : 0;
  for (int i = threadIdx.x; i < vectors; i += kAdamWThreads) {
    float4 p = reinterpret_cast<const float4*>(param)[i];
    float4 mi = reinterpret_cast<const float4*>(m)[i];
    float4 vi = reinterpret_cast<const float4*>(v)[i];
    adamw_update4(p, reinterpret_cast<const float4*>(grad)[i], mi, vi, c, weight_decay, clip);
    reinterpret_cast<float4*>(param)[i] = p;
    reinterpret_cast<float4*>(m)[i] = mi;
    reinterpret_cast<float4*>(v)[i] = vi;
    copy.put4(4 * static_cast<int64_t>(i), p);
  }
  for (int i = 4 * vectors + threadIdx.x; i < n; i += kAdamWThreads) {
    float p = param[i], mi = m[i], vi = v[i];
    adamw_update(p, grad[i], mi, vi, c, weight_decay, clip);
    param[i] = p;
    m[i] = mi;
    v[i] = vi;
    copy.put(i, p);
  }
}

/// The tile source (quantize_tile.cuh) of a tensor with an FP8 cast: the step on the tile's
/// elements, with param, m, v and the optional bf16 copy written back, and the updated values
/// staged for the tile quantizer, which writes the cast's row-wise and transposed copies, its
/// scales and the amax from them in the same pass, bitwise what ops::quantize would write after
/// the step.
/// The element update is written out as in the chunk kernel rather than shared through a helper
/// struct: through one the compiler loses the chunk kernel's __restrict__ and stops overlapping its
/// iterations' loads (half the loads in flight, by its SASS).
struct AdamWTileSource {
  float* param;
  const float* grad;
  float* m;
  float* v;
  uint16_t* bf16;  ///< the bf16 copy, or nullptr
  const float* norm_sq;
  AdamWCoefficients c;
  float weight_decay;
  bool vec;  ///< param, grad, m and v 16-byte aligned, the copy 8-byte, cols a multiple of 4

  __device__ void stage(const quant::TileParams& p, float* tile, int64_t r0, int64_t c0) const {
    using L = quant::TileLayout<float>;
    static_assert(L::kChunkElems == 4, "a chunk of the tile is one float4");
    const float clip = adamw_clip_factor(*norm_sq, c.max_grad_norm);
    const Bf16Chunk copy{bf16};
    for (int i = 0; i < quant::kTile * L::kChunksPerRow / quant::kTileThreads; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * quant::kTileThreads;
      const int r = idx / L::kChunksPerRow, j = idx % L::kChunksPerRow;
      const int64_t gr = r0 + r, gc = c0 + static_cast<int64_t>(j) * L::kChunkElems;
      float4 updated = {0.0f, 0.0f, 0.0f, 0.0f};  // cells outside the matrix stay 0
      const int64_t at = gr * p.cols + gc;
      if (gr < p.rows && vec && gc + L::kChunkElems <= p.cols) {
        float4 mi = *reinterpret_cast<const float4*>(m + at);
        float4 vi = *reinterpret_cast<const float4*>(v + at);
        updated = *reinterpret_cast<const float4*>(param + at);
        adamw_update4(updated, *reinterpret_cast<const float4*>(grad + at), mi, vi, c, weight_decay,
                      clip);
        *reinterpret_cast<float4*>(param + at) = updated;
        *reinterpret_cast<float4*>(m + at) = mi;
        *reinterpret_cast<float4*>(v + at) = vi;
        copy.put4(at, updated);
      } else if (gr < p.rows) {
        float* cell = &updated.x;
#pragma unroll
        for (int e = 0; e < L::kChunkElems; ++e) {
          if (gc + e >= p.cols) continue;
          float pe = param[at + e], me = m[at + e], ve = v[at + e];
          adamw_update(pe, grad[at + e], me, ve, c, weight_decay, clip);
          param[at + e] = pe;
          m[at + e] = me;
          v[at + e] = ve;
          copy.put(at + e, pe);
          cell[e] = pe;
        }
      }
      *reinterpret_cast<float4*>(tile + L::chunk_offset(r, j)) = updated;
    }
    __syncthreads();
  }
};

}  // namespace

// ----------------------------------------------------------------------------
// kernel launchers

void tensor_norm_sums(const Tensor* grads, int count, const Tensor& sums) {
  const Device& device = sums.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);

  int64_t total_chunks = 0;
  for (int i = 0; i < count; ++i) total_chunks += ceil_div(grads[i].numel(), kNormChunk);
  // A stream-ordered workspace of 8-byte slots holding doubles (octet has no f64 dtype).
  Tensor partials = Tensor::empty({total_chunks}, DType::i64, device);
  auto* partials_data = static_cast<double*>(partials.raw_data());
  auto* sums_data = static_cast<double*>(sums.raw_data());

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
                                                                    sums_data);
    OCTET_CHECK_LAUNCH();
    next_chunk = batch.first_chunk[batch.count];
  }
}

void sum_tensor_norms(const Tensor& sums, const Tensor& norm_sq) {
  const Device& device = norm_sq.device();
  DeviceGuard guard(device);
  norm_total_kernel<<<1, 1, 0, octet::cuda::stream(device)>>>(
      static_cast<const double*>(sums.raw_data()), static_cast<int>(sums.numel()),
      norm_sq.data<float>());
  OCTET_CHECK_LAUNCH();
}

void adamw_step(const AdamWTensor* tensors, int count, const Tensor& norm_sq,
                const AdamWCoefficients& coefficients) {
  const Device& device = norm_sq.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  std::vector<quant::TileMatrix<AdamWTileSource>> casts;
  AdamWBatch batch{};
  const auto launch = [&] {
    if (batch.first_chunk[batch.count] == 0) return;  // only empty tensors
    adamw_multi_tensor_kernel<<<static_cast<unsigned>(batch.first_chunk[batch.count]),
                                kAdamWThreads, 0, stream>>>(batch, norm_sq.data<float>(),
                                                            coefficients);
    OCTET_CHECK_LAUNCH();
    batch = AdamWBatch{};
  };
  for (int i = 0; i < count; ++i) {
    const AdamWTensor& t = tensors[i];
    auto* copy = t.bf16_copy.defined() ? static_cast<uint16_t*>(t.bf16_copy.raw_data()) : nullptr;
    if (t.cast != nullptr) {
      if (t.param.numel() == 0) continue;
      // As the chunk kernel's test, with every row start aligned too (cols a multiple of 4).
      const uintptr_t addresses = reinterpret_cast<uintptr_t>(t.param.raw_data()) |
                                  reinterpret_cast<uintptr_t>(t.grad.raw_data()) |
                                  reinterpret_cast<uintptr_t>(t.m.raw_data()) |
                                  reinterpret_cast<uintptr_t>(t.v.raw_data()) |
                                  2 * reinterpret_cast<uintptr_t>(copy);
      const bool vec = t.param.cols() % 4 == 0 && addresses % alignof(float4) == 0;
      casts.push_back({t.param.rows(), t.param.cols(), t.cast->out, &t.cast->args,
                       AdamWTileSource{t.param.data<float>(), t.grad.data<float>(),
                                       t.m.data<float>(), t.v.data<float>(), copy,
                                       norm_sq.data<float>(), coefficients, t.weight_decay, vec}});
      continue;
    }
    const int j = batch.count++;
    batch.param[j] = t.param.data<float>();
    batch.grad[j] = t.grad.data<float>();
    batch.m[j] = t.m.data<float>();
    batch.v[j] = t.v.data<float>();
    batch.numel[j] = t.param.numel();
    batch.weight_decay[j] = t.weight_decay;
    batch.bf16[j] = copy;
    const int64_t next_chunk = batch.first_chunk[j] + ceil_div(t.param.numel(), kAdamWChunk);
    OCTET_CHECK(next_chunk <= INT32_MAX, "adamw_step: ", next_chunk,
                " chunks in one launch exceed the grid limit");
    batch.first_chunk[j + 1] = static_cast<int32_t>(next_chunk);
    if (batch.count == kAdamWMaxTensors) launch();
  }
  if (batch.count > 0) launch();
  quant::quantize_tile_group<float, AdamWTileSource>(casts, device);
}

}  // namespace octet::ops::cuda
