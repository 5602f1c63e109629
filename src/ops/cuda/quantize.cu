// CUDA backend of the quantize family: amax, quantize (per-tensor, 1x128, 128x128, MXFP8; with
// the fused transposed copy), dequantize, cast. Bit-exact with the CPU reference
// (src/ops/cpu/quantize.cc): the same scalar formulas (format.h, scaling_math.h), the same single
// float multiply per element, and maxima over amax bit patterns, which no reduction order changes.
//
// The quantize work horse is the tile kernel of quantize_tile.cuh, staging x by cp.async; a
// per-tensor quantize without a transposed copy is a flat streaming map instead.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "octet/core/cuda_context.h"
#include "octet/core/device.h"
#include "ops/cuda/fp8_kernels.cuh"
#include "ops/cuda/quantize_tile.cuh"
#include "ops/quantize_backend.h"
#include "ops/reduce_backend.h"

namespace octet::ops::cuda {
namespace quant {
namespace {

using fp8::ScalingMode;

/// Parameters of dequantize over the stored copy's own [rows, cols] (blocks as the CPU's row-wise
/// BlockGrid: per_tensor is one rows x cols block).
struct DequantParams {
  const uint8_t* q;
  void* out;
  int64_t rows, cols;
  const void* scale_inv;  ///< f32, or e8m0 bits when e8m0
  int64_t block_rows, block_cols, scale_cols;
  int block_shift;  ///< log2(block_cols), for ScaleLookup::flat_blocks
  bool e8m0;
  bool vec;  ///< q and out aligned and cols % 16 == 0
};

/// x86 quiet bit and default NaN ("real indefinite"): what the CPU reference produces.
constexpr uint32_t kQuietNaNBit = 0x00400000u;
constexpr uint32_t kX86DefaultNaN = 0xFFC00000u;

/// decoded * scale_inv, with the NaN bits the x86 CPU reference gets where a GPU returns its
/// canonical 0x7FFFFFFF: a NaN operand propagates quieted, and an invalid product (0 * inf) is the
/// x86 default NaN. When both are NaN, x86 returns its first source operand, and GCC 12 (-O2 and
/// -O3) makes that scale_inv in the reference's `decode(q) * scale_inv`; a compiler that commutes
/// the operands would pick the other NaN. Only f32 dequantize output can show NaN bits: every
/// other path canonicalizes NaN when it encodes.
__device__ __forceinline__ float mul_like_host(float decoded, float scale_inv) {
  const float p = decoded * scale_inv;
  if (p == p) return p;
  if (scale_inv != scale_inv) return fp8::bits_float(fp8::float_bits(scale_inv) | kQuietNaNBit);
  if (decoded != decoded) return fp8::bits_float(fp8::float_bits(decoded) | kQuietNaNBit);
  return fp8::bits_float(kX86DefaultNaN);
}

// ----------------------------------------------------------------------------
// CUDA kernels

/// amax: element 0 of *amax (as bits) = max(itself, abs_bits(x[i]) for all i).
/// Reads n * sizeof(T) bytes once (16-byte loads, grid-stride over 16-element runs, one atomic
/// per CTA): expect ~90% of HBM read bandwidth on large tensors.
template <typename T>
__global__ void __launch_bounds__(kFlatThreads)
    amax_kernel(const T* __restrict__ x, int64_t n, bool vec, uint32_t* amax) {
  __shared__ uint32_t scratch[kFlatThreads / kWarpSize];
  uint32_t m = 0;
  for_each_run(x, n, vec, [&](int64_t, const float* v) { m = max(m, run_amax_bits(v)); });
  publish_amax<kFlatThreads>(m, amax, scratch);
}

/// Per-tensor quantization without a transposed copy: data = fp8(x * scale[0]), scale_inv[0] =
/// 1 / scale[0], optional amax. A streaming map over the flat matrix: reads n * sizeof(T) and
/// writes n bytes with 16-byte accesses; expect ~90% of copy bandwidth (3 B per bf16 element).
template <typename T, DType kFp8>
__global__ void __launch_bounds__(kFlatThreads)
    quantize_per_tensor_kernel(const T* __restrict__ x, int64_t n, bool vec,
                               const float* __restrict__ scale, uint8_t* __restrict__ data,
                               float* __restrict__ scale_inv, uint32_t* amax) {
  __shared__ uint32_t scratch[kFlatThreads / kWarpSize];
  const float multiplier = *scale;
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = fp8::scale_inv_of(multiplier);
  uint32_t m = 0;
  for_each_run(x, n, vec, [&](int64_t i, const float* v) {
    if (amax != nullptr) m = max(m, run_amax_bits(v));
    store_fp8_run(data + i, n - i, vec, quantize_run<kFp8>(v, multiplier));
  });
  if (amax != nullptr) publish_amax<kFlatThreads>(m, amax, scratch);
}

/// Where a dequantize run finds its scale_inv.
enum class ScaleLookup {
  tensor,       ///< one for the whole tensor (per_tensor): read once per thread
  flat_blocks,  ///< 1-row blocks tiling whole rows: block = flat index >> block_shift
  general,      ///< any block grid: block = (r / block_rows) * scale_cols + c / block_cols
};

/// True when a byte of the word is an FP8 code the hardware decode may not give the reference's
/// bits for: E4M3's NaN (S.1111.111), E5M2's inf and NaN (S.11111.xx). A per-byte compare without
/// carries between bytes: the masked byte plus one step reaches 0x80 exactly when it is all ones.
template <DType kFp8>
__device__ __forceinline__ bool has_special_code(uint32_t w) {
  if constexpr (kFp8 == DType::e4m3) {
    return (((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u) != 0;
  } else {
    return (((w & 0x7C7C7C7Cu) + 0x04040404u) & 0x80808080u) != 0;
  }
}

/// Elements of one dequantize run: one 16-byte vector of the output (8 bf16, 4 f32), so that the
/// lanes of a warp store consecutive 16-byte vectors and every store instruction fills whole
/// 32-byte sectors. (With 16-element runs a lane stored 32 or 64 contiguous bytes in two or four
/// instructions, each writing half or a quarter of every sector it touched: the L2 took two or
/// four partial writes a sector and saturated before DRAM did.)
template <typename TOut>
inline constexpr int kDequantRunElems = kVecElems<TOut>;

/// v[e] = decode(byte e of w) * scale_inv for a run of kN codes (kN / 4 words), bit-equal to the
/// CPU's `decode(q) * scale_inv`. A run of ordinary codes under a finite scale_inv takes the
/// hardware pair decode (cvt to f16x2: exact, every E4M3 and E5M2 value is an f16) and cannot make
/// a NaN; a run holding a NaN or inf code, or under a non-finite scale_inv, takes the formula and
/// mul_like_host's NaN bits. One branch per run, not per element.
template <DType kFp8, int kN>
__device__ __forceinline__ void decode_run(const uint32_t (&w)[kN / 4], float scale_inv,
                                           float (&v)[kN]) {
  bool special = false;
#pragma unroll
  for (int k = 0; k < kN / 4; ++k) special = special || has_special_code<kFp8>(w[k]);
  if (!special && isfinite(scale_inv)) {
#pragma unroll
    for (int k = 0; k < kN / 2; ++k) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>(w[k / 2] >> (16 * (k % 2)));
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, kFp8Interp<kFp8>)));
      v[2 * k] = f.x * scale_inv;
      v[2 * k + 1] = f.y * scale_inv;
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < kN; ++e) {
    const uint8_t q = static_cast<uint8_t>(w[e / 4] >> (8 * (e % 4)));
    v[e] = mul_like_host(fp8::decode_fp8(q, kFp8), scale_inv);
  }
}

/// out = decode(q) * scale_inv of q's block, as f32 or bf16, over runs of kN = kDequantRunElems
/// elements of rows (a run never straddles a block: block widths are multiples of 16). Reads 1 B
/// + writes sizeof(TOut) per element; aligned runs load their kN codes in one access and store one
/// 16-byte vector, and a warp's accesses are contiguous: a memory-bound map. The tensor and
/// flat_blocks lookups need p.vec (so run s starts at element kN s) and skip the general form's
/// 64-bit divisions; each thread loads kRuns runs before it decodes any, to keep 32 bytes of codes
/// in flight.
template <typename TOut, DType kFp8, ScaleLookup kLookup>
__global__ void __launch_bounds__(kFlatThreads) dequantize_kernel(const DequantParams p) {
  constexpr int kN = kDequantRunElems<TOut>, kWords = kN / 4, kRuns = 32 / kN;
  const int64_t runs_per_row = (p.cols + kN - 1) / kN;
  const int64_t runs = p.rows * runs_per_row;
  TOut* out = static_cast<TOut*>(p.out);
  const auto scale_of = [&](int64_t block) {
    return p.e8m0 ? fp8::decode_e8m0(static_cast<const uint8_t*>(p.scale_inv)[block])
                  : static_cast<const float*>(p.scale_inv)[block];
  };
  const float tensor_scale_inv = kLookup == ScaleLookup::tensor ? scale_of(0) : 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kFlatThreads;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kFlatThreads + threadIdx.x;
       first < runs; first += kRuns * stride) {
    uint32_t w[kRuns][kWords] = {};
    int64_t at[kRuns], count[kRuns];
    float scale_inv[kRuns];
#pragma unroll
    for (int k = 0; k < kRuns; ++k) {
      const int64_t s = first + k * stride;
      if (s >= runs) break;
      if constexpr (kLookup == ScaleLookup::general) {
        const int64_t r = s / runs_per_row, c = (s % runs_per_row) * kN;
        at[k] = r * p.cols + c;
        count[k] = p.cols - c;
        scale_inv[k] = scale_of((r / p.block_rows) * p.scale_cols + c / p.block_cols);
      } else {
        at[k] = s * kN;
        count[k] = kN;
        scale_inv[k] = kLookup == ScaleLookup::tensor ? tensor_scale_inv
                                                      : scale_of(at[k] >> p.block_shift);
      }
      if (p.vec && count[k] >= kN) {
        if constexpr (kWords == 2) {
          const uint2 u = *reinterpret_cast<const uint2*>(p.q + at[k]);
          w[k][0] = u.x, w[k][1] = u.y;
        } else {
          static_assert(kWords == 1, "runs of 4 or 8 codes");
          w[k][0] = *reinterpret_cast<const uint32_t*>(p.q + at[k]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kN; ++e)
          if (e < count[k]) w[k][e / 4] |= static_cast<uint32_t>(p.q[at[k] + e]) << (8 * (e % 4));
      }
    }
#pragma unroll
    for (int k = 0; k < kRuns; ++k) {
      if (first + k * stride >= runs) break;
      float v[kN];
      decode_run<kFp8, kN>(w[k], scale_inv[k], v);
      store_run<TOut, kN>(out + at[k], count[k], p.vec, v);
    }
  }
}

/// out = x converted (f32 <-> bf16, round-to-nearest-even via format.h). Reads and writes each
/// element once with 16-byte accesses: 6 B per element, a memory-bound map.
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kFlatThreads)
    cast_kernel(const TIn* __restrict__ x, TOut* __restrict__ out, int64_t n, bool vec) {
  for_each_run(x, n, vec,
               [&](int64_t i, const float* v) { store_run<TOut>(out + i, n - i, vec, v); });
}

/// counts[0..2] += count_fp8_code over every element (integer atomics: order-independent). Each
/// warp sums its lanes' counts with shuffles and adds them once.
template <typename T>
__global__ void __launch_bounds__(kFlatThreads)
    count_fp8_codes_kernel(const T* __restrict__ x, const uint8_t* __restrict__ codes, int64_t n,
                           bool vec, uint8_t max_code, unsigned long long* counts) {
  unsigned long long local[3] = {0, 0, 0};
  for_each_run(x, n, vec, [&](int64_t i, const float* v) {
    const int64_t count = n - i < kRunElems ? n - i : kRunElems;
    for (int64_t k = 0; k < count; ++k) count_fp8_code(v[k], codes[i + k], max_code, local);
  });
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    unsigned long long c = local[j];
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
      c += __shfl_down_sync(0xffffffffu, c, offset);
    if (threadIdx.x % kWarpSize == 0 && c != 0) atomicAdd(counts + j, c);
  }
}

// ----------------------------------------------------------------------------
// Kernel launchers

}  // namespace
}  // namespace quant

void amax(const Tensor& x, const Tensor& amax_out) {
  const Device device = x.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const int64_t n = x.numel();
  auto* amax_bits = static_cast<uint32_t*>(amax_out.raw_data());
  math::visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(x.raw_data());
    const int grid = quant::flat_grid(ceil_div(n, quant::kRunElems), device);
    quant::amax_kernel<T>
        <<<grid, quant::kFlatThreads, 0, stream>>>(p, n, quant::vec_aligned(p), amax_bits);
    OCTET_CHECK_LAUNCH();
  });
}

void quantize(const Tensor& x, fp8::QuantizedTensor& out, const QuantizeArgs& args) {
  using fp8::ScalingMode;
  const Device device = x.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const int64_t rows = x.rows(), cols = x.cols();
  uint32_t* amax_bits = quant::data_or_null<uint32_t>(args.amax);
  const float* scale = quant::data_or_null<const float>(args.scale);

  bool sums_done = false;
  math::visit_dtype(x.dtype(), [&](auto in_tag) {
    using T = decltype(in_tag);
    const T* xp = static_cast<const T*>(x.raw_data());
    if (out.mode == ScalingMode::per_tensor && !out.has_columnwise()) {
      // No transpose: a streaming map over the flat matrix.
      const int64_t n = rows * cols;
      auto* data = static_cast<uint8_t*>(out.data.raw_data());
      auto* scale_inv = static_cast<float*>(out.scale_inv.raw_data());
      const int grid = quant::flat_grid(ceil_div(n, quant::kRunElems), device);
      const bool vec = quant::vec_aligned(xp) && quant::vec_aligned(data);
      visit_fp8(out.dtype, [&](auto fp8_tag) {
        quant::quantize_per_tensor_kernel<T, decltype(fp8_tag)::value>
            <<<grid, quant::kFlatThreads, 0, stream>>>(xp, n, vec, scale, data, scale_inv,
                                                       amax_bits);
        OCTET_CHECK_LAUNCH();
      });
      return;
    }
    const quant::LoadTile<T> source{xp, quant::vec_aligned(xp) && cols % quant::kVecElems<T> == 0};
    sums_done = quant::quantize_tiles<T>(rows, cols, out, args, source, device);
  });
  // Column sums ride on the tile kernel's column pass; without a transposed copy there is none,
  // and sum_rows reads x again.
  if (args.column_sums.defined() && !sums_done)
    sum_rows(x, args.column_sums, args.accumulate_column_sums);
}

void quantize_groups(const Tensor& x, std::span<const int64_t> offsets,
                     std::span<const FusedQuantize> targets) {
  const Device device = x.device();
  DeviceGuard guard(device);
  const int64_t cols = x.cols();
  const Tensor matrix = x.view({-1, cols});
  math::visit_dtype(x.dtype(), [&](auto in_tag) {
    using T = decltype(in_tag);
    using Source = quant::LoadTile<T>;
    std::vector<quant::TileMatrix<Source>> matrices;
    for (size_t g = 0; g < targets.size(); ++g) {
      const int64_t rows = offsets[g + 1] - offsets[g];
      if (rows == 0 || targets[g].out == nullptr) continue;
      const FusedQuantize& target = targets[g];
      // Column sums ride on the transposed copy's pass; without one, quantize adds a sum_rows.
      if (target.args.column_sums.defined() && !target.out->has_columnwise()) {
        cuda::quantize(matrix.slice(offsets[g], offsets[g + 1]), *target.out, target.args);
        continue;
      }
      const T* xg = static_cast<const T*>(matrix.raw_data()) + offsets[g] * cols;
      const Source source{xg, quant::vec_aligned(xg) && cols % quant::kVecElems<T> == 0};
      matrices.push_back({rows, cols, target.out, &target.args, source});
    }
    quant::quantize_tile_group<T, Source>(matrices, device);
  });
}

void dequantize(const fp8::QuantizedTensor& q, const Tensor& out, bool transposed) {
  using fp8::ScalingMode;
  const Device device = out.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const Tensor& data = transposed ? q.data_t : q.data;
  const Tensor& scale_inv = transposed ? q.scale_inv_t : q.scale_inv;
  quant::DequantParams p{};
  p.q = static_cast<const uint8_t*>(data.raw_data());
  p.out = out.raw_data();
  p.rows = data.size(0);
  p.cols = data.size(1);
  p.scale_inv = scale_inv.raw_data();
  // The stored copy's scales follow the row-wise rule for its own [rows, cols].
  switch (q.mode) {
    case ScalingMode::per_tensor:
      p.block_rows = p.rows, p.block_cols = p.cols;
      break;
    case ScalingMode::block_1x128:
      p.block_rows = 1, p.block_cols = fp8::kBlock;
      break;
    case ScalingMode::block_128x128:
      p.block_rows = fp8::kBlock, p.block_cols = fp8::kBlock;
      break;
    case ScalingMode::mxfp8_1x32:
      p.block_rows = 1, p.block_cols = fp8::kMxBlock;
      break;
  }
  p.scale_cols = ceil_div(p.cols, p.block_cols);
  p.e8m0 = q.mode == ScalingMode::mxfp8_1x32;
  p.vec = quant::vec_aligned(p.q) && quant::vec_aligned(p.out) && p.cols % quant::kRunElems == 0;
  // Row-wise blocks of a power-of-two width that tile whole rows: the block of element i is
  // i >> block_shift (1x128 and MXFP8 at the usual widths).
  const bool flat_blocks = p.vec && p.block_rows == 1 && p.cols % p.block_cols == 0 &&
                           (p.block_cols & (p.block_cols - 1)) == 0;
  p.block_shift = flat_blocks ? __builtin_ctzll(static_cast<uint64_t>(p.block_cols)) : 0;
  const quant::ScaleLookup lookup = q.mode == ScalingMode::per_tensor && p.vec
                                        ? quant::ScaleLookup::tensor
                                    : flat_blocks ? quant::ScaleLookup::flat_blocks
                                                  : quant::ScaleLookup::general;
  // One pass of the loop per thread (two runs), not flat_grid's grid of every resident thread:
  // this kernel's registers let fewer CTAs share an SM than flat_grid counts, and a grid-stride
  // grid sized for more than fit runs a second, partly empty wave. Here SMs refill as CTAs end.
  const int64_t runs = p.rows * ceil_div(p.cols, quant::kRunElems);
  const int grid =
      static_cast<int>(std::min<int64_t>(ceil_div(runs, 2 * quant::kFlatThreads), INT_MAX));
  math::visit_dtype(out.dtype(), [&](auto out_tag) {
    using TOut = decltype(out_tag);
    visit_fp8(q.dtype, [&](auto fp8_tag) {
      constexpr DType kFp8 = decltype(fp8_tag)::value;
      switch (lookup) {
        case quant::ScaleLookup::tensor:
          quant::dequantize_kernel<TOut, kFp8, quant::ScaleLookup::tensor>
              <<<grid, quant::kFlatThreads, 0, stream>>>(p);
          break;
        case quant::ScaleLookup::flat_blocks:
          quant::dequantize_kernel<TOut, kFp8, quant::ScaleLookup::flat_blocks>
              <<<grid, quant::kFlatThreads, 0, stream>>>(p);
          break;
        case quant::ScaleLookup::general:
          quant::dequantize_kernel<TOut, kFp8, quant::ScaleLookup::general>
              <<<grid, quant::kFlatThreads, 0, stream>>>(p);
          break;
      }
      OCTET_CHECK_LAUNCH();
    });
  });
}

void cast(const Tensor& x, const Tensor& out) {
  const Device device = x.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  if (x.dtype() == out.dtype()) {
    OCTET_CHECK_CUDA(cudaMemcpyAsync(out.raw_data(), x.raw_data(), x.nbytes(),
                                     cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const int64_t n = x.numel();
  const int grid = quant::flat_grid(ceil_div(n, quant::kRunElems), device);
  const bool vec = quant::vec_aligned(x.raw_data()) && quant::vec_aligned(out.raw_data());
  if (x.dtype() == DType::f32) {
    quant::cast_kernel<float, uint16_t><<<grid, quant::kFlatThreads, 0, stream>>>(
        static_cast<const float*>(x.raw_data()), static_cast<uint16_t*>(out.raw_data()), n, vec);
  } else {
    quant::cast_kernel<uint16_t, float><<<grid, quant::kFlatThreads, 0, stream>>>(
        static_cast<const uint16_t*>(x.raw_data()), static_cast<float*>(out.raw_data()), n, vec);
  }
  OCTET_CHECK_LAUNCH();
}

void count_fp8_codes(const Tensor& x, const Tensor& codes, const Tensor& counts) {
  const Device device = x.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const int64_t n = x.numel();
  const uint8_t max_code = fp8::encode_fp8(fp8::fp8_max(codes.dtype()), codes.dtype());
  static_assert(sizeof(unsigned long long) == sizeof(int64_t), "i64 counts as CUDA's atomics");
  auto* out = static_cast<unsigned long long*>(counts.raw_data());
  const auto* c = static_cast<const uint8_t*>(codes.raw_data());
  math::visit_dtype(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(x.raw_data());
    const int grid = quant::flat_grid(ceil_div(n, quant::kRunElems), device);
    quant::count_fp8_codes_kernel<T>
        <<<grid, quant::kFlatThreads, 0, stream>>>(p, c, n, quant::vec_aligned(p), max_code, out);
    OCTET_CHECK_LAUNCH();
  });
}

}  // namespace octet::ops::cuda
