// Device building blocks shared by the CUDA quantize kernels (quantize.cu): 16-element runs loaded
// and stored with 16-byte vectors, FP8 encoding through the hardware converter, max reductions over
// amax bit patterns, and the ordered amax publication of DESIGN.md rule 1.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "octet/core/cuda_context.h"
#include "octet/core/dtype.h"
#include "octet/fp8/format.h"
#include "octet/fp8/scaling_math.h"
#include "ops/cuda/launch_util.cuh"

namespace octet::ops::cuda::quant {

/// Bytes of one vector access (LDG.128 / STG.128 / LDS.128 / cp.async.cg).
inline constexpr int kVecBytes = 16;
/// Elements a thread handles as one run: 16 FP8 bytes make one 16-byte store.
inline constexpr int kRunElems = 16;
/// CTA size of the grid-stride (flat) kernels; flat_grid() fills the device with them.
inline constexpr int kFlatThreads = 256;

/// Elements of T in one 16-byte vector (T: float, or uint16_t holding bf16 bits).
template <typename T>
inline constexpr int kVecElems = kVecBytes / static_cast<int>(sizeof(T));

/// True when `p` may be accessed with 16-byte vectors.
inline bool vec_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(kVecBytes) == 0;
}

/// Blocks of kFlatThreads for a grid-stride loop over `items`: enough to fill every SM, no more.
inline int flat_grid(int64_t items, const Device& device) {
  const cudaDeviceProp& props = octet::cuda::properties(device);
  const int64_t resident = static_cast<int64_t>(props.multiProcessorCount) *
                           props.maxThreadsPerMultiProcessor / kFlatThreads;
  const int64_t needed = (items + kFlatThreads - 1) / kFlatThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min(needed, resident)));
}

// ----------------------------------------------------------------------------
// Element conversions

/// Input element as float; bf16 travels as its raw bits (decode_bf16 is exact).
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(uint16_t v) { return fp8::decode_bf16(v); }

/// Float as an output element: f32 as is, bf16 through format.h's round-to-nearest-even encoder.
template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return v;
  } else {
    return fp8::encode_bf16(v);
  }
}

/// The 16-byte vector `u` of T elements as floats.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& u, float* out) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == sizeof(float)) {
      out[i] = __uint_as_float(w[i]);
    } else {  // two bf16 per word, the lower address in the low half
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  }
}

/// CUDA's name for an FP8 dtype (e4m3 or e5m2).
template <DType kFp8>
inline constexpr __nv_fp8_interpretation_t kFp8Interp = kFp8 == DType::e4m3 ? __NV_E4M3 : __NV_E5M2;

/// fp8(a) | fp8(b) << 8. On sm_89+ this is cvt.rn.satfinite.{e4m3,e5m2}x2.f32, bit-identical to
/// format.h's encode_e4m3/encode_e5m2 over all float inputs (their NaN goes to 0x7F too).
template <DType kFp8>
__device__ __forceinline__ uint32_t encode_fp8x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFp8Interp<kFp8>);
}

/// fp8(v[i] * multiplier) for a 16-element run, packed as one 16-byte vector (v[0] lowest byte).
/// One float multiply per element, as the CPU's quantize_value.
template <DType kFp8>
__device__ __forceinline__ uint4 quantize_run(const float* v, float multiplier) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = encode_fp8x2<kFp8>(v[4 * i] * multiplier, v[4 * i + 1] * multiplier);
    const uint32_t hi = encode_fp8x2<kFp8>(v[4 * i + 2] * multiplier, v[4 * i + 3] * multiplier);
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/// max over abs_bits of a 16-element run.
__device__ __forceinline__ uint32_t run_amax_bits(const float* v) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kRunElems; ++i) m = max(m, fp8::abs_bits(v[i]));
  return m;
}

// ----------------------------------------------------------------------------
// Global memory runs: 16 elements starting at p, of which `count` (possibly <= 0 or > 16) exist.
// `vec` says p is 16-byte aligned; a full aligned run moves as 16-byte vectors, anything else
// element by element (the scalar fallback for awkward shapes and pointers).

template <typename T>
__device__ __forceinline__ void load_run(const T* p, int64_t count, bool vec, float* v) {
  if (vec && count >= kRunElems) {
    constexpr int kVectors = kRunElems / kVecElems<T>;
    uint4 u[kVectors];
#pragma unroll
    for (int i = 0; i < kVectors; ++i)
      u[i] = reinterpret_cast<const uint4*>(p)[i];  // all in flight
#pragma unroll
    for (int i = 0; i < kVectors; ++i) unpack<T>(u[i], v + i * kVecElems<T>);
  } else {
#pragma unroll
    for (int i = 0; i < kRunElems; ++i) v[i] = i < count ? to_float(p[i]) : 0.0f;
  }
}

/// The grid-stride loop of the flat kernels (kFlatThreads per CTA): calls f(i, v) for every
/// 16-element run of x[0, n), i its first index and v its values as floats (0 past n).
template <typename T, typename F>
__device__ __forceinline__ void for_each_run(const T* x, int64_t n, bool vec, F&& f) {
  const int64_t runs = (n + kRunElems - 1) / kRunElems;
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * kFlatThreads + threadIdx.x; s < runs;
       s += static_cast<int64_t>(gridDim.x) * kFlatThreads) {
    const int64_t i = s * kRunElems;
    float v[kRunElems];
    load_run(x + i, n - i, vec, v);
    f(i, v);
  }
}

/// p[0], p[stride], p[2 stride], p[3 stride] as one word, p[0] the low byte: four rows of one
/// column of a byte tile in shared memory, which an FP8 transpose stores as consecutive bytes.
__device__ __forceinline__ uint32_t gather_column_word(const uint8_t* p, int64_t stride) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[stride]) << 8 |
         static_cast<uint32_t>(p[2 * stride]) << 16 | static_cast<uint32_t>(p[3 * stride]) << 24;
}

/// Stores a 16-byte FP8 run (see quantize_run).
__device__ __forceinline__ void store_fp8_run(uint8_t* p, int64_t count, bool vec, const uint4& q) {
  if (vec && count >= kRunElems) {
    *reinterpret_cast<uint4*>(p) = q;
  } else {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < kRunElems; ++i)
      if (i < count) p[i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
  }
}

/// Stores kN floats (a whole number of 16-byte vectors of T) as T (f32, or bf16 bits).
template <typename T, int kN = kRunElems>
__device__ __forceinline__ void store_run(T* p, int64_t count, bool vec, const float* v) {
  static_assert(kN % kVecElems<T> == 0, "runs of whole 16-byte vectors");
  if (vec && count >= kN) {
    constexpr int kVectors = kN / kVecElems<T>;
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float* s = v + i * kVecElems<T>;
        if constexpr (sizeof(T) == sizeof(float)) {
          w[k] = __float_as_uint(s[k]);
        } else {
          w[k] = fp8::encode_bf16x2(s[2 * k], s[2 * k + 1]);
        }
      }
      reinterpret_cast<uint4*>(p)[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i)
      if (i < count) p[i] = from_float<T>(v[i]);
  }
}

// ----------------------------------------------------------------------------
// Reductions of amax bit patterns (unsigned max: exact, order-independent, NaN wins)

/// Max of v over the lanes whose lane ids differ only in the bits of kLaneBits (an aligned group
/// of lanes, e.g. 0b00111 = each 8 consecutive lanes). Every lane of the warp must call it.
template <unsigned kLaneBits>
__device__ __forceinline__ uint32_t lane_group_max(uint32_t v) {
#pragma unroll
  for (unsigned bit = 1; bit < static_cast<unsigned>(kWarpSize); bit <<= 1)
    if (kLaneBits & bit) v = max(v, __shfl_xor_sync(kFullMask, v, bit));
  return v;
}

/// Max of v over the CTA, returned to every thread. scratch: one word per warp. Every thread of
/// the CTA must call it. It begins with a __syncthreads(), which also frees scratch from a
/// previous call, and every thread's earlier stores precede that barrier.
template <int kThreads>
__device__ __forceinline__ uint32_t block_max(uint32_t v, uint32_t* scratch) {
  static_assert(kThreads % kWarpSize == 0, "whole warps only");
  v = __reduce_max_sync(kFullMask, v);
  __syncthreads();  // scratch is free (a previous use has been read by everyone)
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  uint32_t m = 0;
#pragma unroll
  for (int w = 0; w < kThreads / kWarpSize; ++w) m = max(m, scratch[w]);
  return m;
}

/// Raises *amax (the bits of a non-negative f32, or of a NaN) to this CTA's max of v. Every thread
/// of the CTA must call it, after all of its FP8 stores.
template <int kThreads>
__device__ __forceinline__ void publish_amax(uint32_t v, uint32_t* amax, uint32_t* scratch) {
  const uint32_t m = block_max<kThreads>(v, scratch);
  // DESIGN.md rule 1 (FIELD-NOTES.md #1): the FP8 data must be complete before the amax that
  // describes it is published. block_max's __syncthreads() comes after every FP8 store of this
  // CTA; the publishing thread then fences at device scope, and only then does the relaxed
  // atomicMax. One atomic per CTA.
  if (threadIdx.x == 0) {
    __threadfence();
    atomicMax(amax, m);
  }
}

}  // namespace octet::ops::cuda::quant
