// CUDA backend of the optimizer family. global_norm_squared reduces in the fixed order of
// optimizer_backend.h (per-chunk partials, per-tensor sums of the partials, tensors in the given
// order), with no float atomics; adamw_step runs optimizer_math.h's scalar step over all tensors in
// one launch. Both equal the CPU reference bit for bit, and neither synchronises with the host
// (the clip factor is read from norm_sq on the device) nor allocates for the step.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "octet/core/cuda_context.h"
#include "octet/fp8/scaling_math.h"
#include "ops/cuda/fp8_kernels.cuh"
#include "ops/cuda/launch_util.cuh"
#include "ops/fixed_order_reduce.h"
#include "ops/optimizer_backend.h"
#include "ops/quantize_backend.h"

namespace octet::ops::cuda {
namespace {

/// Threads per block of the element-wise AdamW kernel.
constexpr int kAdamWThreads = 256;
/// Tensors per launch of the AdamW kernel: as many as fit in the parameters (81 bytes each with
/// the FP8 cast's and the bf16 copy's pointers), so GPT-2 1.5B's 580 parameter tensors take two
/// launches.
constexpr int kAdamWMaxTensors = 400;
/// Side of the square tile of the FP8 transpose that makes a cast's transposed copy.
constexpr int kTransposeTile = 64;
constexpr int kTransposeThreads = 256;
/// 16-byte segments of a tile row: each thread moves one on load and one on store.
constexpr int kTransposeSegments = kTransposeTile / 16;
static_assert(kTransposeTile * kTransposeSegments == kTransposeThreads, "one segment per thread");
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

/// A batch of tensors for the AdamW kernel, passed by value as a __grid_constant__ parameter (no
/// descriptor table to allocate and upload, so a step stays free of host copies). Tensor j owns
/// the CTAs [first_chunk[j], first_chunk[j + 1]) of the launch, one per kAdamWChunk elements.
struct AdamWBatch {
  float* param[kAdamWMaxTensors];
  const float* grad[kAdamWMaxTensors];
  float* m[kAdamWMaxTensors];
  float* v[kAdamWMaxTensors];
  int64_t numel[kAdamWMaxTensors];
  float weight_decay[kAdamWMaxTensors];
  /// The FP8 cast of the updated tensor (AdamWTensor::cast): the row-wise codes, the per-tensor
  /// multiplier and the amax to raise; nullptr without a cast.
  uint8_t* fp8[kAdamWMaxTensors];
  const float* fp8_scale[kAdamWMaxTensors];
  uint32_t* fp8_amax[kAdamWMaxTensors];
  bool fp8_e5m2[kAdamWMaxTensors];
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

/// The FP8 side of a chunk whose tensor has a cast: codes of the updated values (the f32
/// multiply and the saturating converter of fp8_kernels/fused_cast, bit-identical to
/// ops::quantize), and the chunk's max |value| as float bits.
struct Fp8Chunk {
  uint8_t* codes = nullptr;  ///< nullptr: no cast
  float scale = 0.0f;
  __nv_fp8_interpretation_t format = __NV_E4M3;
  uint32_t amax_bits = 0;

  __device__ void put(int64_t i, float value) {
    if (codes == nullptr) return;
    codes[i] = __nv_cvt_float_to_fp8(value * scale, __NV_SATFINITE, format);
    amax_bits = max(amax_bits, fp8::abs_bits(value));
  }
  __device__ void put4(int64_t i, const float4& p) {
    if (codes == nullptr) return;
    put(i, p.x);
    put(i + 1, p.y);
    put(i + 2, p.z);
    put(i + 3, p.w);
  }
};

/// The bf16 copy a chunk writes with its update (nothing when `out` is null), rounded as
/// ops::cast rounds.
struct Bf16Chunk {
  uint16_t* out = nullptr;

  __device__ void put(int64_t i, float value) {
    if (out != nullptr) out[i] = fp8::encode_bf16(value);
  }
  /// Four values at i (a multiple of 4, `out` 8-byte aligned): one 8-byte store.
  __device__ void put4(int64_t i, const float4& p) {
    if (out == nullptr) return;
    const uint2 packed = {fp8::encode_bf16x2(p.x, p.y), fp8::encode_bf16x2(p.z, p.w)};
    *reinterpret_cast<uint2*>(out + i) = packed;
  }
};

/// One CTA per chunk of kAdamWChunk elements of one tensor, so large and small tensors share one
/// grid. Every thread derives the clip factor from norm_sq itself (a broadcast load), so the host
/// never waits for the norm. A tensor with a cast also gets its updated values' FP8 codes, and
/// the CTA raises the cast's amax after every code is stored (DESIGN.md rule 1); one with a bf16
/// copy gets its updated values rounded to bf16.
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
  Fp8Chunk cast;
  if (batch.fp8[j] != nullptr) {  // uniform over the CTA
    cast.codes = batch.fp8[j] + begin;
    cast.scale = *batch.fp8_scale[j];
    cast.format = batch.fp8_e5m2[j] ? __NV_E5M2 : __NV_E4M3;
  }

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
    cast.put4(4 * static_cast<int64_t>(i), p);
    copy.put4(4 * static_cast<int64_t>(i), p);
  }
  for (int i = 4 * vectors + threadIdx.x; i < n; i += kAdamWThreads) {
    float p = param[i], mi = m[i], vi = v[i];
    adamw_update(p, grad[i], mi, vi, c, weight_decay, clip);
    param[i] = p;
    m[i] = mi;
    v[i] = vi;
    cast.put(i, p);
    copy.put(i, p);
  }
  if (cast.codes == nullptr || batch.fp8_amax[j] == nullptr) return;  // uniform over the CTA
  __shared__ uint32_t scratch[kAdamWThreads / kWarpSize];
  quant::publish_amax<kAdamWThreads>(cast.amax_bits, batch.fp8_amax[j], scratch);
}

/// The transposed copy of an FP8 matrix: out [cols, rows] from in [rows, cols], one 64x64 tile
/// per CTA through shared memory (16-byte global accesses when the tile is whole and aligned).
/// CTA (0, 0) also writes the cast's scale_inv (and scale_inv_t when it is a tensor of its own).
__global__ void __launch_bounds__(kTransposeThreads)
    fp8_transpose_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out, int64_t rows,
                         int64_t cols, const float* __restrict__ scale, float* scale_inv,
                         float* scale_inv_t) {
  // Rows padded by 4 bytes: the 16 rows a store gathers from start in different banks.
  __shared__ __align__(16) uint8_t tile[kTransposeTile][kTransposeTile + 4];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTransposeTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTransposeTile;
  const int line = static_cast<int>(threadIdx.x) / kTransposeSegments;  // a row of the tile
  const int seg = static_cast<int>(threadIdx.x) % kTransposeSegments;   // its 16-byte segment
  const bool whole = r0 + kTransposeTile <= rows && c0 + kTransposeTile <= cols;
  const bool vec_in = whole && cols % 16 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0;
  const bool vec_out = whole && rows % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  {
    const int64_t r = r0 + line, c = c0 + seg * 16;
    uint32_t* dst = reinterpret_cast<uint32_t*>(&tile[line][seg * 16]);
    if (vec_in) {
      const uint4 v = *reinterpret_cast<const uint4*>(in + r * cols + c);
      dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
    } else {
      for (int k = 0; k < 16; ++k)
        tile[line][seg * 16 + k] = (r < rows && c + k < cols) ? in[r * cols + c + k] : 0;
    }
  }
  __syncthreads();
  {
    const int64_t r = c0 + line, c = r0 + seg * 16;  // out's row (in's column) and columns
    uint32_t word[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      word[q] = quant::gather_column_word(&tile[seg * 16 + 4 * q][line], sizeof(tile[0]));
    }
    if (vec_out) {
      *reinterpret_cast<uint4*>(out + r * rows + c) =
          make_uint4(word[0], word[1], word[2], word[3]);
    } else if (r < cols) {
      for (int k = 0; k < 16 && c + k < rows; ++k)
        out[r * rows + c + k] = static_cast<uint8_t>(word[k / 4] >> (8 * (k % 4)));
    }
  }
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    const float inverse = fp8::scale_inv_of(*scale);
    if (scale_inv != nullptr) *scale_inv = inverse;
    if (scale_inv_t != nullptr) *scale_inv_t = inverse;
  }
}

}  // namespace

// ----------------------------------------------------------------------------
// kernel launchers

/// After the step's kernel: the cast's transposed copy from its row-wise codes, and its scales.
/// A cast with only the transposed copy (nothing for the step's kernel to store) is quantized
/// from the updated parameter instead.
void finish_cast(const AdamWTensor& t, cudaStream_t stream) {
  const fp8::QuantizedTensor& q = *t.cast->out;
  if (!q.has_rowwise()) {
    fp8::QuantizedTensor out = q;
    cuda::quantize(t.param, out, t.cast->args);
    return;
  }
  const int64_t rows = t.param.rows(), cols = t.param.cols();
  float* scale_inv_t = q.has_columnwise() && q.scale_inv_t.raw_data() != q.scale_inv.raw_data()
                           ? q.scale_inv_t.data<float>()
                           : nullptr;
  const int64_t tiles_x = ceil_div(cols, kTransposeTile), tiles_y = ceil_div(rows, kTransposeTile);
  OCTET_CHECK(tiles_y <= kMaxGridY, "adamw_step: a [", rows, ", ", cols,
              "] cast exceeds the transpose's grid");
  // Without a transposed copy one CTA still writes the scales (and moves nothing).
  const bool transposed = q.has_columnwise();
  fp8_transpose_kernel<<<dim3(static_cast<unsigned>(transposed ? tiles_x : 1),
                              static_cast<unsigned>(transposed ? tiles_y : 1)),
                         kTransposeThreads, 0, stream>>>(
      static_cast<const uint8_t*>(q.data.raw_data()),
      transposed ? static_cast<uint8_t*>(q.data_t.raw_data()) : nullptr, transposed ? rows : 0,
      transposed ? cols : 0, t.cast->args.scale.data<float>(), q.scale_inv.data<float>(),
      scale_inv_t);
  OCTET_CHECK_LAUNCH();
}

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
  for (int first = 0; first < count; first += kAdamWMaxTensors) {
    AdamWBatch batch{};
    batch.count = std::min(kAdamWMaxTensors, count - first);
    for (int j = 0; j < batch.count; ++j) {
      const AdamWTensor& t = tensors[first + j];
      batch.param[j] = t.param.data<float>();
      batch.grad[j] = t.grad.data<float>();
      batch.m[j] = t.m.data<float>();
      batch.v[j] = t.v.data<float>();
      batch.numel[j] = t.param.numel();
      batch.weight_decay[j] = t.weight_decay;
      if (t.cast != nullptr) {
        const fp8::QuantizedTensor& q = *t.cast->out;
        batch.fp8[j] = q.has_rowwise() ? static_cast<uint8_t*>(q.data.raw_data()) : nullptr;
        batch.fp8_scale[j] = t.cast->args.scale.data<float>();
        batch.fp8_amax[j] = t.cast->args.amax.defined()
                                ? static_cast<uint32_t*>(t.cast->args.amax.raw_data())
                                : nullptr;
        batch.fp8_e5m2[j] = q.dtype == DType::e5m2;
      }
      if (t.bf16_copy.defined()) batch.bf16[j] = static_cast<uint16_t*>(t.bf16_copy.raw_data());
      const int64_t next_chunk = batch.first_chunk[j] + ceil_div(t.param.numel(), kAdamWChunk);
      OCTET_CHECK(next_chunk <= INT32_MAX, "adamw_step: ", next_chunk,
                  " chunks in one launch exceed the grid limit");
      batch.first_chunk[j + 1] = static_cast<int32_t>(next_chunk);
    }
    adamw_multi_tensor_kernel<<<static_cast<unsigned>(batch.first_chunk[batch.count]),
                                kAdamWThreads, 0, stream>>>(batch, norm_sq.data<float>(),
                                                            coefficients);
    OCTET_CHECK_LAUNCH();
  }
  for (int i = 0; i < count; ++i) {
    if (tensors[i].cast != nullptr) finish_cast(tensors[i], stream);
  }
}

}  // namespace octet::ops::cuda
