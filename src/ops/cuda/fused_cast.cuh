// Device pieces that the norm and activation kernels share: 16-byte packs for vectorized global
// access, a fixed-order CTA reduction, and the epilogue that stores an output and, when a
// FusedCast is on, its FP8 codes and amax (norm_backend.h). CUDA sources only.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "octet/core/device.h"
#include "octet/fp8/scaling_math.h"
#include "ops/activation_math.h"
#include "ops/cuda/launch_util.cuh"
#include "ops/norm_backend.h"

namespace octet::ops::cuda {

/// Bytes of the widest global load and store (LDG.128 / STG.128).
inline constexpr int kVectorBytes = 16;

/// Elements of T in one 16-byte access: 4 f32 or 8 bf16.
template <typename T>
inline constexpr int kVectorWidth = kVectorBytes / static_cast<int>(sizeof(T));

/// kN consecutive elements, aligned so that a pack of up to 16 bytes is one access (a 32-byte
/// pack of f32 gammas is two).
template <typename T, int kN>
struct alignas(sizeof(T) * kN < kVectorBytes ? sizeof(T) * kN : kVectorBytes) Pack {
  T v[kN];
};

/// Loads the pack at `p`, which must be aligned to the pack (see vector_aligned()).
template <int kN, typename T>
__device__ __forceinline__ Pack<T, kN> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, kN>*>(p);
}

template <int kN, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, kN>& v) {
  *reinterpret_cast<Pack<T, kN>*>(p) = v;
}

/// The kN elements at p (aligned to the pack) as floats.
template <int kN, typename T>
__device__ __forceinline__ void load_floats(const T* p, float (&v)[kN]) {
  const Pack<T, kN> pack = load_pack<kN>(p);
#pragma unroll
  for (int k = 0; k < kN; ++k) v[k] = math::to_float(pack.v[k]);
}

/// Stores T's zero at p[0, kN).
template <int kN, typename T>
__device__ __forceinline__ void store_zeros(T* p) {
  store_pack<kN>(p, Pack<T, kN>{});
}

/// True when every pointer may be accessed in 16-byte packs (null pointers are ignored).
inline bool vector_aligned(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % kVectorBytes != 0) return false;
  return true;
}

/// Runs f(std::integral_constant<int, kN>{}) with kN = kVectorWidth<T> (16-byte packs) when `unit`
/// (the extent a pack must not straddle, e.g. a row) is a multiple of the pack and every pointer is
/// aligned; else kN = 1, one element at a time.
template <typename T, typename F>
void visit_pack(int64_t unit, std::initializer_list<const void*> pointers, F&& f) {
  if (unit % kVectorWidth<T> == 0 && vector_aligned(pointers)) {
    f(std::integral_constant<int, kVectorWidth<T>>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
  // A butterfly: both partners of each step combine the same two values, so with a commutative
  // op every lane ends with bitwise the same result.
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

/// Reduces v over the whole CTA (its size a multiple of 32) in a fixed order; every thread gets
/// the result. Contains barriers: every thread of the CTA must call it. shared: 32 elements.
template <typename V, typename Op>
__device__ V block_reduce(V v, Op op, V identity, V* shared) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int warps = blockDim.x * blockDim.y / kWarpSize;
  const int lane = tid % kWarpSize;
  v = warp_reduce(v, op);
  __syncthreads();  // `shared` may still be read by a previous reduction
  if (lane == 0) shared[tid / kWarpSize] = v;
  __syncthreads();
  return warp_reduce(lane < warps ? shared[lane] : identity, op);
}

struct MaxOp {
  __device__ __forceinline__ uint32_t operator()(uint32_t a, uint32_t b) const {
    return a > b ? a : b;
  }
};

/// A thread's side of a FusedCast: the scale, and the running max of |stored output| as bits.
struct CastThread {
  FusedCast cast;
  float scale = 0.0f;
  uint32_t amax_bits = 0;

  __device__ explicit CastThread(const FusedCast& c) : cast(c) {
    if (c.enabled()) scale = *c.scale;
  }
};

/// fp8(v * scale) for each element of the pack, through the hardware converter
/// (cvt.rn.satfinite.{e4m3,e5m2}x2.f32 on sm_89+): bit-identical to format.h's encoders, which
/// tests/fp8/format_test.cc proves over every float, and so to ops::quantize. One float multiply
/// per element, as fp8::quantize_value.
template <int kN>
__device__ __forceinline__ Pack<uint8_t, kN> encode_pack(const float (&v)[kN], float scale,
                                                         DType dtype) {
  const __nv_fp8_interpretation_t format = dtype == DType::e4m3 ? __NV_E4M3 : __NV_E5M2;
  Pack<uint8_t, kN> q;
  if constexpr (kN % 2 == 0) {
    // Pairs land in the pack as halfwords, so the codes are assembled by whole words.
    __nv_fp8x2_storage_t pairs[kN / 2];  // .x is the low byte
#pragma unroll
    for (int k = 0; k < kN / 2; ++k) {
      pairs[k] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * k] * scale, v[2 * k + 1] * scale),
                                          __NV_SATFINITE, format);
    }
    memcpy(&q, pairs, sizeof(q));
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k)
      q.v[k] = __nv_cvt_float_to_fp8(v[k] * scale, __NV_SATFINITE, format);
  }
  return q;
}

/// v rounded to T, as a pack; bf16 pairs take one conversion each (fp8::encode_bf16x2).
template <typename T, int kN>
__device__ __forceinline__ Pack<T, kN> round_pack(const float (&v)[kN]) {
  Pack<T, kN> o;
  if constexpr (sizeof(T) == sizeof(uint16_t) && kN % 2 == 0) {
    uint32_t words[kN / 2];
#pragma unroll
    for (int k = 0; k < kN / 2; ++k) words[k] = fp8::encode_bf16x2(v[2 * k], v[2 * k + 1]);
    memcpy(&o, words, sizeof(o));
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k) o.v[k] = math::from_float<T>(v[k]);
  }
  return o;
}

/// Rounds v to T and stores it at out[i, i + kN) (unless out is nullptr: a kernel that writes
/// every FP8 copy of an unwanted output); with the cast on, also its FP8 codes at cast.data[i,
/// ...) (the cast copy has the output's layout), quantizing the value as rounded, exactly as
/// ops::quantize would read it back. Returns the codes (zeros with the cast off).
template <typename T, int kN>
__device__ __forceinline__ Pack<uint8_t, kN> store_output(T* out, int64_t i, const float (&v)[kN],
                                                          CastThread& ct) {
  const Pack<T, kN> o = round_pack<T>(v);
  if (out != nullptr) store_pack<kN>(out + i, o);
  Pack<uint8_t, kN> q{};
  if (!ct.cast.enabled()) return q;
  float stored[kN];
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    stored[k] = math::to_float(o.v[k]);
    const uint32_t bits = fp8::abs_bits(stored[k]);
    ct.amax_bits = bits > ct.amax_bits ? bits : ct.amax_bits;
  }
  q = encode_pack<kN>(stored, ct.scale, ct.cast.dtype);
  store_pack<kN>(ct.cast.data + i, q);
  return q;
}

/// Ends a fused cast; every thread of the CTA calls it after its last store_output (it contains
/// barriers). CTA 0 writes scale_inv; with an amax to record, the CTA's max |y| is folded in.
__device__ __forceinline__ void finish_cast(const CastThread& ct, uint32_t* shared) {
  if (!ct.cast.enabled()) return;  // uniform over the grid
  const uint32_t cta_bits = block_reduce(ct.amax_bits, MaxOp{}, 0u, shared);
  const bool leader = threadIdx.x == 0 && threadIdx.y == 0;
  if (leader && blockIdx.x == 0) {
    *ct.cast.scale_inv = fp8::scale_inv_of(ct.scale);
    if (ct.cast.scale_inv_t != nullptr) *ct.cast.scale_inv_t = fp8::scale_inv_of(ct.scale);
  }
  if (ct.cast.amax == nullptr) return;
  // DESIGN.md rule 1: the FP8 data (and y) must be complete before the amax is published. The
  // barrier waits until every thread of the CTA has issued its stores; the device-scope fence
  // then orders them before the atomic, which a relaxed atomicMax alone does not (FIELD-NOTES.md
  // section 1: corrupt gradients that a fence here made go away). The max is over the bits of
  // |y|, which order like the values (NaN above inf), exactly as the CPU reference takes it.
  __syncthreads();
  if (leader) {
    __threadfence();
    atomicMax(reinterpret_cast<unsigned int*>(ct.cast.amax), cta_bits);
  }
}

}  // namespace octet::ops::cuda
