// CUDA causal attention (forward and backward) and RoPE.
//
// Two paths compute the same function (the CPU reference in src/ops/cpu/attention.cc):
// - bf16 with head_dim 64 or 128 and 16-byte aligned tensors: flash-attention-2 style kernels on
//   BF16 tensor cores (mma.sync.m16n8k16, f32 accumulation). A CTA of 4 warps owns 64 rows
//   (queries, or keys in the dK/dV kernel), 16 per warp; the other operand streams through
//   double-buffered shared memory (cp.async), tiles entirely above the causal diagonal are never
//   visited, and the softmax is online (running max and sum per row, base 2). P and dS are
//   rounded to bf16 to feed the tensor cores, as in FlashAttention-2.
// - everything else (f32, other head_dims up to kMaxHeadDim, unaligned views): one warp per row,
//   lanes over head_dim, all f32 on CUDA cores. Simple, and fast enough for tests and small
//   models.
// The backward never sums floats with atomics (DESIGN.md rule 3): one kernel computes dK and dV
// per key tile by iterating over queries, another dQ per query tile by iterating over keys, so
// every output element has one owner that sums in a fixed order. Both recompute P from lse.
//
// Cost at GPT-2 1.5B's training shape (B=8, T=1024, H=25, D=64, bf16), per layer:
// - forward: 2 GEMMs (Q K^T, P V) of 2*B*H*T^2*D/2 flops each (causal half):
//   4*B*H*T^2*D/2 = 26.8 GFLOP;
// - backward: 7 such GEMMs (S^T, dP^T, dV, dK in one kernel; S, dP, dQ in the other; S and dP
//   are computed twice to avoid atomics) = 94 GFLOP.
// Expected (an estimate, not a measurement): mma.sync kernels of this simplicity reach roughly
// 150-250 TFLOPS forward and 100-150 TFLOPS backward on an H100/H200 (FlashAttention-2 reaches
// ~350 forward), so ~0.15 ms forward and ~0.7 ms backward per layer: ~40 ms per step of 48 layers
// against ~120 ms for the model's GEMMs (6 * 1.56e9 params * 8192 tokens = 77 TFLOP at ~650
// TFLOPS), about a quarter of the step.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "octet/core/cuda_context.h"
#include "octet/fp8/format.h"
#include "ops/attention_backend.h"

namespace octet::ops::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
/// The fast kernels work in base 2 (exp2f is a single MUFU.EX2): scores are scaled by log2(e),
/// and lse converts back with ln(2).
constexpr float kLog2e = 1.44269504088896340736f;
constexpr float kLn2 = 0.69314718055994530942f;

// Fast path. mma.sync.m16n8k16 multiplies a 16x16 A by a 16x8 B (PTX ISA, "Warp-level matrix
// multiply-accumulate instructions", shape .m16n8k16 for .bf16).
constexpr int kMmaM = 16;
constexpr int kMmaN = 8;
constexpr int kMmaK = 16;
constexpr int kFastWarps = 4;
constexpr int kFastThreads = kFastWarps * kWarpSize;
/// Rows a CTA owns: queries in the forward and dQ kernels, keys in the dK/dV kernel.
constexpr int kTile = kFastWarps * kMmaM;  // 64
/// Shared-memory rows are padded by 8 bf16 (16 bytes): rows stay 16-byte aligned for cp.async and
/// ldmatrix, and consecutive rows start 4 banks apart (row stride = 4 mod 32 words for head_dim 64
/// and 128), so the 8 rows x 4 words of a fragment load hit 32 distinct banks.
constexpr int kPad = 8;
/// bf16 elements per 16-byte cp.async.
constexpr int kChunk = 8;
constexpr uintptr_t kFastAlignment = 16;
/// The largest gridDim.y (CUDA Programming Guide, "Compute Capabilities": 65535).
constexpr int64_t kMaxGridY = 65535;

/// Rows of the streamed operand per step of the backward kernels (queries in dK/dV, keys in dQ):
/// two f32 accumulators of 16 x head_dim plus two 16 x step score tiles must fit in a thread's
/// 255 registers: 64 + 64 + 32 + 32 floats at head_dim 64, 64 + 64 + 16 + 16 halves at 128.
template <int kD>
constexpr int backward_step() {
  static_assert(kD == 64 || kD == 128, "the register budget is sized for head_dim 64 and 128");
  return kD == 64 ? 64 : 32;
}

// Simple path.
constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / kWarpSize;
constexpr int kSimpleThreads = 128;
constexpr int kElementwiseThreads = 256;

// ----------------------------------------------------------------------------
// Device helpers

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(uint16_t x) { return fp8::decode_bf16(x); }
__device__ __forceinline__ void store_f32(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f32(uint16_t* p, float v) { *p = fp8::encode_bf16(v); }

/// Sum over the warp by xor butterfly: every lane ends with the same bits, in a fixed order.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

/// Index of the calling thread's warp in a 1-D grid.
__device__ __forceinline__ int64_t global_warp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// 16 bytes global -> shared, asynchronously; zero-fills (reading nothing) when !valid.
__device__ __forceinline__ void cp_async_16(uint16_t* dst, const uint16_t* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
/// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

/// c += a * b for one m16n8k16 tile (bf16 in, f32 accumulate).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// Four 8x8 bf16 matrices from shared memory, transposed: lanes 8i..8i+7 give the row addresses
/// of matrix i, and lane l receives rows 2*(l%4), 2*(l%4)+1 of column l/4 of each matrix.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p))
               : "memory");
}

/// Two consecutive bf16 (the first in the low half), as one 32-bit word.
__device__ __forceinline__ uint32_t load_pair(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) is the low half
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating
// point type"), with g = lane / 4 and t = lane % 4:
// - A (16x16, row-major), 4 words of 2 bf16: {row g, cols 2t..2t+1}, {row g+8, cols 2t..},
//   {row g, cols 2t+8..}, {row g+8, cols 2t+8..};
// - B (16x8, "col"), 2 words: {rows 2t..2t+1, col g}, {rows 2t+8..2t+9, col g};
// - C (16x8, f32), 4 floats: {row g, cols 2t, 2t+1}, {row g+8, cols 2t, 2t+1}.
// Two adjacent C tiles (cols 0-7, 8-15) of the same rows therefore hold exactly the A fragment
// of those 16 columns, which is how P and dS feed the next product without shared memory.

/// A fragments of the warp's 16 rows x kK columns, stored at `rows` (row stride kK + kPad).
template <int kK>
__device__ __forceinline__ void load_a(uint32_t (&a)[kK / kMmaK][4], const uint16_t* rows) {
  constexpr int kStride = kK + kPad;
  const int lane = threadIdx.x % kWarpSize, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kc = 0; kc < kK / kMmaK; ++kc) {
    const uint16_t* p = rows + g * kStride + kc * kMmaK + 2 * t;
    a[kc][0] = load_pair(p);
    a[kc][1] = load_pair(p + 8 * kStride);
    a[kc][2] = load_pair(p + 8);
    a[kc][3] = load_pair(p + 8 * kStride + 8);
  }
}

/// acc (16 x kN) += A (16 x kK) * B^T, where B is kN rows of kK in shared memory (row stride
/// kK + kPad): the "rows times rows" product, e.g. S = Q K^T. B's fragment {rows 2t.., col g}
/// of B^T is two consecutive elements of B's row g.
template <int kN, int kK>
__device__ __forceinline__ void mma_abt(float (&acc)[kN / kMmaN][4],
                                        const uint32_t (&a)[kK / kMmaK][4], const uint16_t* b) {
  constexpr int kStride = kK + kPad;
  const int lane = threadIdx.x % kWarpSize, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < kN / kMmaN; ++nt) {
#pragma unroll
    for (int kc = 0; kc < kK / kMmaK; ++kc) {
      const uint16_t* p = b + (nt * kMmaN + g) * kStride + kc * kMmaK + 2 * t;
      mma_bf16(acc[nt], a[kc], load_pair(p), load_pair(p + 8));
    }
  }
}

/// acc (16 x kN) += A (16 x kK) * B, where B is kK rows of kN in shared memory (row stride
/// kN + kPad): e.g. O += P V. B's fragments need two elements of one column, so they come
/// through ldmatrix.trans: lanes 0-15 address rows kc*16 + 0..15 at column np*16, lanes 16-31
/// the same rows at column np*16 + 8, giving {b0, b1} of n-tiles 2np and 2np+1.
template <int kK, int kN>
__device__ __forceinline__ void mma_ab(float (&acc)[kN / kMmaN][4],
                                       const uint32_t (&a)[kK / kMmaK][4], const uint16_t* b) {
  constexpr int kStride = kN + kPad;
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int kc = 0; kc < kK / kMmaK; ++kc) {
#pragma unroll
    for (int np = 0; np < kN / (2 * kMmaN); ++np) {
      uint32_t f[4];
      ldmatrix_x4_trans(
          f, b + (kc * kMmaK + lane % 16) * kStride + np * 2 * kMmaN + lane / 16 * kMmaN);
      mma_bf16(acc[2 * np], a[kc], f[0], f[1]);
      mma_bf16(acc[2 * np + 1], a[kc], f[2], f[3]);
    }
  }
}

/// The f32 C fragments of a 16 x kN tile, rounded to bf16, as A fragments over its kN columns.
template <int kN>
__device__ __forceinline__ void c_to_a(const float (&c)[kN / kMmaN][4],
                                       uint32_t (&a)[kN / kMmaK][4]) {
#pragma unroll
  for (int kc = 0; kc < kN / kMmaK; ++kc) {
    a[kc][0] = pack_bf16x2(c[2 * kc][0], c[2 * kc][1]);
    a[kc][1] = pack_bf16x2(c[2 * kc][2], c[2 * kc][3]);
    a[kc][2] = pack_bf16x2(c[2 * kc + 1][0], c[2 * kc + 1][1]);
    a[kc][3] = pack_bf16x2(c[2 * kc + 1][2], c[2 * kc + 1][3]);
  }
}

/// Stores the warp's 16 x kD f32 tile as bf16 rows of a token-major matrix (row r at
/// dst + r * stride), rows g scaled by mul_lo and rows g+8 by mul_hi; rows >= valid are skipped.
template <int kD>
__device__ __forceinline__ void store_rows(const float (&acc)[kD / kMmaN][4], uint16_t* dst,
                                           int64_t stride, int valid, float mul_lo, float mul_hi) {
  const int lane = threadIdx.x % kWarpSize, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < kD / kMmaN; ++nt) {
    const int col = nt * kMmaN + 2 * t;
    if (g < valid) {
      *reinterpret_cast<uint32_t*>(dst + g * stride + col) =
          pack_bf16x2(acc[nt][0] * mul_lo, acc[nt][1] * mul_lo);
    }
    if (g + 8 < valid) {
      *reinterpret_cast<uint32_t*>(dst + (g + 8) * stride + col) =
          pack_bf16x2(acc[nt][2] * mul_hi, acc[nt][3] * mul_hi);
    }
  }
}

/// Starts copying kRows x kD bf16 of a token-major matrix (row r at src + r * stride) into
/// shared rows of kD + kPad; rows >= valid are zero-filled, so padding never holds NaN garbage
/// that a zero probability would turn into NaN.
template <int kRows, int kD>
__device__ __forceinline__ void load_tile(uint16_t* dst, const uint16_t* src, int64_t stride,
                                          int valid) {
  constexpr int kChunksPerRow = kD / kChunk;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kFastThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < kChunks / kFastThreads; ++i) {
    const int c = i * kFastThreads + threadIdx.x;
    const int r = c / kChunksPerRow, col = c % kChunksPerRow * kChunk;
    const bool ok = r < valid;
    cp_async_16(dst + r * (kD + kPad) + col, src + (ok ? r * stride + col : 0), ok);
  }
}

// ----------------------------------------------------------------------------
// CUDA kernels: bf16 tensor-core path

/// The dynamic shared memory of the tensor-core kernels, as bf16.
__device__ __forceinline__ uint16_t* shared_bf16() {
  extern __shared__ __align__(16) unsigned char attention_smem[];
  return reinterpret_cast<uint16_t*>(attention_smem);
}

/// Forward. Grid (B*H, ceil(T/64)); the CTA owns queries [q0, q0+64) of one head and streams key
/// tiles 0..q_tile (the causal diagonal tile last, the only one that needs masking). Query tiles
/// run from the last (most work) to the first, for a balanced tail.
template <int kD>
__global__ void __launch_bounds__(kFastThreads)
    attention_forward_bf16_kernel(const uint16_t* __restrict__ qkv, uint16_t* __restrict__ out,
                                  float* __restrict__ lse, int T, int H, float scale_log2) {
  static_assert(kD == 64 || kD == 128, "tiles and register use are sized for head_dim 64 and 128");
  constexpr int kStride = kD + kPad;
  constexpr int kTileElems = kTile * kStride;
  uint16_t* q_s = shared_bf16();         // [kTile][kStride]
  uint16_t* k_s = q_s + kTileElems;      // [2][kTile][kStride]
  uint16_t* v_s = k_s + 2 * kTileElems;  // [2][kTile][kStride]

  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int q_tile = gridDim.y - 1 - blockIdx.y;
  const int q0 = q_tile * kTile;
  const int64_t stride = 3LL * H * kD;
  const uint16_t* q_g = qkv + static_cast<int64_t>(b) * T * stride + static_cast<int64_t>(h) * kD;
  const uint16_t* k_g = q_g + static_cast<int64_t>(H) * kD;
  const uint16_t* v_g = k_g + static_cast<int64_t>(H) * kD;

  load_tile<kTile, kD>(q_s, q_g + q0 * stride, stride, T - q0);
  cp_async_commit();
  load_tile<kTile, kD>(k_s, k_g, stride, T);
  load_tile<kTile, kD>(v_s, v_g, stride, T);
  cp_async_commit();

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, t = lane % 4;
  const int row0 = q0 + warp * kMmaM + lane / 4;  // this thread's query rows: row0, row0 + 8
  cp_async_wait<1>();                             // Q has landed
  __syncthreads();
  uint32_t qf[kD / kMmaK][4];
  load_a<kD>(qf, q_s + warp * kMmaM * kStride);

  float o[kD / kMmaN][4] = {};
  float m[2] = {-INFINITY, -INFINITY};  // running max of the base-2 scores
  float l[2] = {0.0f, 0.0f};            // running sum of exp2(score - m), this thread's columns
  for (int kt = 0; kt <= q_tile; ++kt) {
    const int buf = kt & 1;
    // Tile kt has landed, and every warp is done with tile kt-1, whose buffer is refilled next.
    cp_async_wait<0>();
    __syncthreads();
    if (kt < q_tile) {
      const int next = (kt + 1) * kTile;
      load_tile<kTile, kD>(k_s + (buf ^ 1) * kTileElems, k_g + next * stride, stride, T - next);
      load_tile<kTile, kD>(v_s + (buf ^ 1) * kTileElems, v_g + next * stride, stride, T - next);
      cp_async_commit();
    }

    float s[kTile / kMmaN][4] = {};
    mma_abt<kTile, kD>(s, qf, k_s + buf * kTileElems);
    const int k0 = kt * kTile;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      float tile_max = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kTile / kMmaN; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = k0 + nt * kMmaN + 2 * t + e;
          float& x = s[nt][2 * r + e];
          x = (kt == q_tile && key > row) ? -INFINITY : x * scale_log2;
          tile_max = fmaxf(tile_max, x);
        }
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
      const float m_new = fmaxf(m[r], tile_max);
      // Key 0 is never masked, so m_new is finite; the guard keeps -inf - -inf (NaN) out anyway.
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2f(m[r] - m_use);
      m[r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kTile / kMmaN; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[nt][2 * r + e];
          x = exp2f(x - m_use);
          sum += x;
        }
      }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int nt = 0; nt < kD / kMmaN; ++nt) {
        o[nt][2 * r] *= alpha;
        o[nt][2 * r + 1] *= alpha;
      }
    }
    uint32_t pf[kTile / kMmaK][4];
    c_to_a<kTile>(s, pf);
    mma_ab<kTile, kD>(o, pf, v_s + buf * kTileElems);
  }

  // Each row's sum is spread over the 4 lanes of its quad.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(kFullMask, l[r], 1);
    l[r] += __shfl_xor_sync(kFullMask, l[r], 2);
  }
  const int first = q0 + warp * kMmaM;
  const int64_t out_stride = static_cast<int64_t>(H) * kD;
  store_rows<kD>(o, out + (static_cast<int64_t>(b) * T + first) * out_stride + h * kD, out_stride,
                 T - first, 1.0f / l[0], 1.0f / l[1]);
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      if (row < T) lse[static_cast<int64_t>(bh) * T + row] = m[r] * kLn2 + logf(l[r]);
    }
  }
}

/// dK and dV. Grid (B*H, ceil(T/64)); the CTA owns keys [k0, k0+64) of one head and streams the
/// query tiles at and after the diagonal: S^T = K Q^T, dP^T = V dO^T, P^T = exp2(S^T - lse),
/// dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q.
template <int kD>
__global__ void __launch_bounds__(kFastThreads)
    attention_dkdv_bf16_kernel(const uint16_t* __restrict__ qkv, const uint16_t* __restrict__ dout,
                               const float* __restrict__ lse, const float* __restrict__ delta,
                               uint16_t* __restrict__ dqkv, int T, int H, float scale,
                               float scale_log2) {
  constexpr int kStep = backward_step<kD>();  // queries per step
  static_assert(kD % kMmaK == 0 && kStep % kMmaK == 0 && kTile % kStep == 0,
                "tiles must be whole mma tiles, and query steps must start on key tiles");
  static_assert(kStep <= kFastThreads, "one thread per query loads the row statistics");
  constexpr int kStride = kD + kPad;
  constexpr int kStepElems = kStep * kStride;
  uint16_t* k_s = shared_bf16();                                   // [kTile][kStride]
  uint16_t* v_s = k_s + kTile * kStride;                           // [kTile][kStride]
  uint16_t* q_s = v_s + kTile * kStride;                           // [2][kStep][kStride]
  uint16_t* do_s = q_s + 2 * kStepElems;                           // [2][kStep][kStride]
  float* lse_s = reinterpret_cast<float*>(do_s + 2 * kStepElems);  // [2][kStep], base 2
  float* delta_s = lse_s + 2 * kStep;                              // [2][kStep]

  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int k0 = blockIdx.y * kTile;  // key tile 0 has the most queries and starts first
  const int64_t stride = 3LL * H * kD, out_stride = static_cast<int64_t>(H) * kD;
  const uint16_t* q_g = qkv + static_cast<int64_t>(b) * T * stride + static_cast<int64_t>(h) * kD;
  const uint16_t* k_g = q_g + out_stride;
  const uint16_t* v_g = k_g + out_stride;
  const uint16_t* do_g =
      dout + static_cast<int64_t>(b) * T * out_stride + static_cast<int64_t>(h) * kD;
  const float* lse_g = lse + static_cast<int64_t>(bh) * T;
  const float* delta_g = delta + static_cast<int64_t>(bh) * T;

  // Queries [q0, q0 + kStep) into buffer `buf`: Q and dO asynchronously, the row statistics by
  // plain stores (lse = +inf past the end makes P = 0 there).
  const auto load_queries = [&](int q0, int buf) {
    load_tile<kStep, kD>(q_s + buf * kStepElems, q_g + q0 * stride, stride, T - q0);
    load_tile<kStep, kD>(do_s + buf * kStepElems, do_g + q0 * out_stride, out_stride, T - q0);
    const int i = threadIdx.x;
    if (i < kStep) {
      lse_s[buf * kStep + i] = q0 + i < T ? lse_g[q0 + i] * kLog2e : INFINITY;
      delta_s[buf * kStep + i] = q0 + i < T ? delta_g[q0 + i] : 0.0f;
    }
  };
  load_tile<kTile, kD>(k_s, k_g + k0 * stride, stride, T - k0);
  load_tile<kTile, kD>(v_s, v_g + k0 * stride, stride, T - k0);
  load_queries(k0, 0);
  cp_async_commit();

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, t = lane % 4;
  const int key0 = k0 + warp * kMmaM + lane / 4;  // this thread's keys: key0, key0 + 8
  const int steps = (T - k0 + kStep - 1) / kStep;
  float dk[kD / kMmaN][4] = {};
  float dv[kD / kMmaN][4] = {};
  for (int j = 0; j < steps; ++j) {
    const int buf = j & 1, q0 = k0 + j * kStep;
    cp_async_wait<0>();
    __syncthreads();
    if (j + 1 < steps) {
      load_queries(q0 + kStep, buf ^ 1);
      cp_async_commit();
    }
    const uint16_t* qb = q_s + buf * kStepElems;
    const uint16_t* dob = do_s + buf * kStepElems;
    const float* lse_b = lse_s + buf * kStep;
    const float* delta_b = delta_s + buf * kStep;

    float st[kStep / kMmaN][4] = {};   // S^T: this warp's 16 keys x kStep queries
    float dpt[kStep / kMmaN][4] = {};  // dP^T
    {
      uint32_t af[kD / kMmaK][4];
      load_a<kD>(af, k_s + warp * kMmaM * kStride);
      mma_abt<kStep, kD>(st, af, qb);
      load_a<kD>(af, v_s + warp * kMmaM * kStride);
      mma_abt<kStep, kD>(dpt, af, dob);
    }
    const bool masked = q0 < k0 + kTile || q0 + kStep > T;
#pragma unroll
    for (int nt = 0; nt < kStep / kMmaN; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = nt * kMmaN + 2 * t + (e & 1);  // query within the step
        const int key = key0 + (e >= 2 ? 8 : 0);
        float p = exp2f(st[nt][e] * scale_log2 - lse_b[qi]);
        if (masked && (key > q0 + qi || q0 + qi >= T)) p = 0.0f;
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - delta_b[qi]);
      }
    }
    uint32_t af[kStep / kMmaK][4];
    c_to_a<kStep>(st, af);
    mma_ab<kStep, kD>(dv, af, dob);
    c_to_a<kStep>(dpt, af);
    mma_ab<kStep, kD>(dk, af, qb);
  }

  const int first = k0 + warp * kMmaM;
  uint16_t* dk_g = dqkv + (static_cast<int64_t>(b) * T + first) * stride + out_stride +
                   static_cast<int64_t>(h) * kD;
  store_rows<kD>(dk, dk_g, stride, T - first, scale, scale);
  store_rows<kD>(dv, dk_g + out_stride, stride, T - first, 1.0f, 1.0f);
}

/// dQ. Grid (B*H, ceil(T/64)); the CTA owns queries [q0, q0+64) of one head and streams the key
/// tiles up to the diagonal: S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K.
template <int kD>
__global__ void __launch_bounds__(kFastThreads)
    attention_dq_bf16_kernel(const uint16_t* __restrict__ qkv, const uint16_t* __restrict__ dout,
                             const float* __restrict__ lse, const float* __restrict__ delta,
                             uint16_t* __restrict__ dqkv, int T, int H, float scale,
                             float scale_log2) {
  constexpr int kStep = backward_step<kD>();  // keys per step
  static_assert(kD % kMmaK == 0 && kStep % kMmaK == 0, "tiles must be whole mma tiles");
  constexpr int kStride = kD + kPad;
  constexpr int kStepElems = kStep * kStride;
  uint16_t* q_s = shared_bf16();           // [kTile][kStride]
  uint16_t* do_s = q_s + kTile * kStride;  // [kTile][kStride]
  uint16_t* k_s = do_s + kTile * kStride;  // [2][kStep][kStride]
  uint16_t* v_s = k_s + 2 * kStepElems;    // [2][kStep][kStride]

  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int q_tile = gridDim.y - 1 - blockIdx.y;
  const int q0 = q_tile * kTile;
  const int64_t stride = 3LL * H * kD, out_stride = static_cast<int64_t>(H) * kD;
  const uint16_t* q_g = qkv + static_cast<int64_t>(b) * T * stride + static_cast<int64_t>(h) * kD;
  const uint16_t* k_g = q_g + out_stride;
  const uint16_t* v_g = k_g + out_stride;
  const uint16_t* do_g =
      dout + static_cast<int64_t>(b) * T * out_stride + static_cast<int64_t>(h) * kD;

  load_tile<kTile, kD>(q_s, q_g + q0 * stride, stride, T - q0);
  load_tile<kTile, kD>(do_s, do_g + q0 * out_stride, out_stride, T - q0);
  cp_async_commit();
  load_tile<kStep, kD>(k_s, k_g, stride, T);
  load_tile<kStep, kD>(v_s, v_g, stride, T);
  cp_async_commit();

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, t = lane % 4;
  const int row0 = q0 + warp * kMmaM + lane / 4;  // this thread's query rows: row0, row0 + 8
  float lse2[2], row_delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    // Past the end, lse = +inf makes P = 0.
    lse2[r] = row < T ? lse[static_cast<int64_t>(bh) * T + row] * kLog2e : INFINITY;
    row_delta[r] = row < T ? delta[static_cast<int64_t>(bh) * T + row] : 0.0f;
  }
  cp_async_wait<1>();  // Q and dO have landed
  __syncthreads();
  uint32_t qf[kD / kMmaK][4], dof[kD / kMmaK][4];
  load_a<kD>(qf, q_s + warp * kMmaM * kStride);
  load_a<kD>(dof, do_s + warp * kMmaM * kStride);

  const int keys = min(q0 + kTile, T);
  const int steps = (keys + kStep - 1) / kStep;
  float dq[kD / kMmaN][4] = {};
  for (int j = 0; j < steps; ++j) {
    const int buf = j & 1, k0 = j * kStep;
    cp_async_wait<0>();
    __syncthreads();
    if (j + 1 < steps) {
      const int next = k0 + kStep;
      load_tile<kStep, kD>(k_s + (buf ^ 1) * kStepElems, k_g + next * stride, stride, T - next);
      load_tile<kStep, kD>(v_s + (buf ^ 1) * kStepElems, v_g + next * stride, stride, T - next);
      cp_async_commit();
    }
    const uint16_t* kb = k_s + buf * kStepElems;
    const uint16_t* vb = v_s + buf * kStepElems;

    float s[kStep / kMmaN][4] = {};
    float dp[kStep / kMmaN][4] = {};
    mma_abt<kStep, kD>(s, qf, kb);
    mma_abt<kStep, kD>(dp, dof, vb);
    const bool masked = k0 + kStep > q0 || k0 + kStep > T;
#pragma unroll
    for (int nt = 0; nt < kStep / kMmaN; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int key = k0 + nt * kMmaN + 2 * t + (e & 1);
        float p = exp2f(s[nt][e] * scale_log2 - lse2[r]);
        if (masked && key > row0 + 8 * r) p = 0.0f;
        s[nt][e] = p * (dp[nt][e] - row_delta[r]);  // dS
      }
    }
    uint32_t dsf[kStep / kMmaK][4];
    c_to_a<kStep>(s, dsf);
    mma_ab<kStep, kD>(dq, dsf, kb);
  }

  const int first = q0 + warp * kMmaM;
  store_rows<kD>(dq, dqkv + (static_cast<int64_t>(b) * T + first) * stride + h * kD, stride,
                 T - first, scale, scale);
}

// ----------------------------------------------------------------------------
// CUDA kernels: simple path (any dtype, head_dim <= kMaxHeadDim) and shared pieces

/// Forward, one warp per (b, h, query i); lane l holds dims l, l+32, ... of q and of the output
/// accumulator; one key at a time with an online softmax.
template <typename Elem>
__global__ void __launch_bounds__(kSimpleThreads)
    attention_forward_simple_kernel(const Elem* __restrict__ qkv, Elem* __restrict__ out,
                                    float* __restrict__ lse, int64_t rows, int T, int H, int D,
                                    float scale) {
  const int64_t w = global_warp();
  if (w >= rows) return;  // whole warps leave together
  const int lane = threadIdx.x % kWarpSize;
  const int i = static_cast<int>(w % T);
  const int64_t bh = w / T, b = bh / H;
  const int h = static_cast<int>(bh % H);
  const int64_t stride = 3LL * H * D;
  const Elem* seq = qkv + b * T * stride + static_cast<int64_t>(h) * D;
  const Elem* q = seq + i * stride;
  const Elem* k = seq + static_cast<int64_t>(H) * D;
  const Elem* v = k + static_cast<int64_t>(H) * D;

  float qr[kPerLane], acc[kPerLane];
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    const int d = lane + c * kWarpSize;
    qr[c] = d < D ? to_f32(q[d]) : 0.0f;
    acc[c] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int j = 0; j <= i; ++j) {
    const Elem* kj = k + j * stride;
    const Elem* vj = v + j * stride;
    float part = 0.0f;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int d = lane + c * kWarpSize;
      if (d < D) part += qr[c] * to_f32(kj[d]);
    }
    const float s = warp_sum(part) * scale;
    const float m_new = fmaxf(m, s);
    const float alpha = expf(m - m_new);  // 0 for the first key (m = -inf)
    const float p = expf(s - m_new);
    l = l * alpha + p;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int d = lane + c * kWarpSize;
      if (d < D) acc[c] = acc[c] * alpha + p * to_f32(vj[d]);
    }
    m = m_new;
  }
  Elem* o = out + (b * T + i) * H * D + static_cast<int64_t>(h) * D;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    const int d = lane + c * kWarpSize;
    if (d < D) store_f32(o + d, acc[c] / l);
  }
  if (lane == 0) lse[bh * T + i] = m + logf(l);
}

/// delta[b, h, t] = dout . out over the head's dims (f32): the softmax backward's row term
/// rowsum(P o dP). One warp per (token, head). Used by both paths.
template <typename Elem>
__global__ void __launch_bounds__(kSimpleThreads)
    attention_delta_kernel(const Elem* __restrict__ dout, const Elem* __restrict__ out,
                           float* __restrict__ delta, int64_t rows, int T, int H, int D) {
  const int64_t w = global_warp();
  if (w >= rows) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t token = w / H;
  const int h = static_cast<int>(w % H);
  const int64_t base = token * H * D + static_cast<int64_t>(h) * D;
  float sum = 0.0f;
  for (int d = lane; d < D; d += kWarpSize) sum += to_f32(dout[base + d]) * to_f32(out[base + d]);
  sum = warp_sum(sum);
  if (lane == 0) delta[((token / T) * H + h) * T + token % T] = sum;
}

/// dQ, one warp per (b, h, query i), iterating over keys j <= i.
template <typename Elem>
__global__ void __launch_bounds__(kSimpleThreads)
    attention_dq_simple_kernel(const Elem* __restrict__ qkv, const Elem* __restrict__ dout,
                               const float* __restrict__ lse, const float* __restrict__ delta,
                               Elem* __restrict__ dqkv, int64_t rows, int T, int H, int D,
                               float scale) {
  const int64_t w = global_warp();
  if (w >= rows) return;
  const int lane = threadIdx.x % kWarpSize;
  const int i = static_cast<int>(w % T);
  const int64_t bh = w / T, b = bh / H;
  const int h = static_cast<int>(bh % H);
  const int64_t stride = 3LL * H * D;
  const Elem* seq = qkv + b * T * stride + static_cast<int64_t>(h) * D;
  const Elem* k = seq + static_cast<int64_t>(H) * D;
  const Elem* v = k + static_cast<int64_t>(H) * D;
  const Elem* g = dout + (b * T + i) * H * D + static_cast<int64_t>(h) * D;
  const float lse_i = lse[bh * T + i], delta_i = delta[bh * T + i];

  float qr[kPerLane], gr[kPerLane], dq[kPerLane];
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    const int d = lane + c * kWarpSize;
    qr[c] = d < D ? to_f32(seq[i * stride + d]) : 0.0f;
    gr[c] = d < D ? to_f32(g[d]) : 0.0f;
    dq[c] = 0.0f;
  }
  for (int j = 0; j <= i; ++j) {
    float kr[kPerLane];
    float qk = 0.0f, gv = 0.0f;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int d = lane + c * kWarpSize;
      kr[c] = d < D ? to_f32(k[j * stride + d]) : 0.0f;
      qk += qr[c] * kr[c];
      if (d < D) gv += gr[c] * to_f32(v[j * stride + d]);
    }
    const float p = expf(warp_sum(qk) * scale - lse_i);
    const float ds = p * (warp_sum(gv) - delta_i);
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) dq[c] += ds * kr[c];
  }
  Elem* dst = dqkv + (b * T + i) * stride + static_cast<int64_t>(h) * D;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    const int d = lane + c * kWarpSize;
    if (d < D) store_f32(dst + d, dq[c] * scale);
  }
}

/// dK and dV, one warp per (b, h, key j), iterating over queries i >= j.
template <typename Elem>
__global__ void __launch_bounds__(kSimpleThreads)
    attention_dkdv_simple_kernel(const Elem* __restrict__ qkv, const Elem* __restrict__ dout,
                                 const float* __restrict__ lse, const float* __restrict__ delta,
                                 Elem* __restrict__ dqkv, int64_t rows, int T, int H, int D,
                                 float scale) {
  const int64_t w = global_warp();
  if (w >= rows) return;
  const int lane = threadIdx.x % kWarpSize;
  const int j = static_cast<int>(w % T);
  const int64_t bh = w / T, b = bh / H;
  const int h = static_cast<int>(bh % H);
  const int64_t stride = 3LL * H * D, out_stride = static_cast<int64_t>(H) * D;
  const Elem* seq = qkv + b * T * stride + static_cast<int64_t>(h) * D;  // q of token 0
  const Elem* g = dout + b * T * out_stride + static_cast<int64_t>(h) * D;
  const float* lse_bh = lse + bh * T;
  const float* delta_bh = delta + bh * T;

  float kr[kPerLane], vr[kPerLane], dk[kPerLane], dv[kPerLane];
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    const int d = lane + c * kWarpSize;
    kr[c] = d < D ? to_f32(seq[j * stride + out_stride + d]) : 0.0f;
    vr[c] = d < D ? to_f32(seq[j * stride + 2 * out_stride + d]) : 0.0f;
    dk[c] = 0.0f;
    dv[c] = 0.0f;
  }
  for (int i = j; i < T; ++i) {
    float qr[kPerLane], gr[kPerLane];
    float qk = 0.0f, gv = 0.0f;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int d = lane + c * kWarpSize;
      qr[c] = d < D ? to_f32(seq[i * stride + d]) : 0.0f;
      gr[c] = d < D ? to_f32(g[i * out_stride + d]) : 0.0f;
      qk += qr[c] * kr[c];
      gv += gr[c] * vr[c];
    }
    const float p = expf(warp_sum(qk) * scale - lse_bh[i]);
    const float ds = p * (warp_sum(gv) - delta_bh[i]);
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      dv[c] += p * gr[c];
      dk[c] += ds * qr[c];
    }
  }
  Elem* dst = dqkv + (b * T + j) * stride + static_cast<int64_t>(h) * D;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    const int d = lane + c * kWarpSize;
    if (d < D) {
      store_f32(dst + out_stride + d, dk[c] * scale);
      store_f32(dst + 2 * out_stride + d, dv[c]);
    }
  }
}

/// RoPE in place, one thread per rotated pair: (token, q or k, head, pair i).
template <typename Elem>
__global__ void rope_kernel(Elem* __restrict__ qkv, int64_t pairs, int T, int H, int D, float theta,
                            bool inverse) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= pairs) return;
  const int half = D / 2;
  const int i = static_cast<int>(idx % half);
  int64_t rest = idx / half;
  const int h = static_cast<int>(rest % H);
  rest /= H;
  const int part = static_cast<int>(rest % 2);  // 0: q, 1: k
  const int64_t token = rest / 2;
  const int t = static_cast<int>(token % T);
  // The contract's f32 expression, written identically in the CPU reference.
  const float angle =
      static_cast<float>(t) * powf(theta, -2.0f * static_cast<float>(i) / static_cast<float>(D));
  float sn, cs;
  sincosf(angle, &sn, &cs);
  if (inverse) sn = -sn;
  Elem* p = qkv + token * 3 * H * D + (static_cast<int64_t>(part) * H + h) * D + 2 * i;
  const float x0 = to_f32(p[0]), x1 = to_f32(p[1]);
  store_f32(p, x0 * cs - x1 * sn);
  store_f32(p + 1, x0 * sn + x1 * cs);
}

// ----------------------------------------------------------------------------
// kernel launchers

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// Blocks of `threads` for `work_threads` threads in a 1-D grid.
unsigned int grid_for(int64_t work_threads, int threads) {
  const int64_t blocks = ceil_div(work_threads, threads);
  OCTET_CHECK(blocks <= INT32_MAX, "attention kernel over ", work_threads,
              " threads exceeds the 1-D grid limit");
  return static_cast<unsigned int>(blocks);
}

/// The 2-D grid of the tensor-core kernels: (B*H, ceil(T/64)).
dim3 tile_grid(const AttentionShape& s) {
  const int64_t heads = s.batch * s.heads, tiles = ceil_div(s.seq, kTile);
  OCTET_CHECK(heads <= INT32_MAX && tiles <= kMaxGridY, "attention: batch*heads = ", heads,
              " must be <= ", INT32_MAX, " and ceil(seq/", kTile, ") = ", tiles, " <= ", kMaxGridY);
  return dim3(static_cast<unsigned int>(heads), static_cast<unsigned int>(tiles));
}

void check_cuda_shape(const AttentionShape& s, const char* op) {
  OCTET_CHECK(s.head_dim <= kMaxHeadDim, op,
              ": the CUDA backend supports head_dim <= ", kMaxHeadDim, ", got ", s.head_dim);
}

/// The tensor-core path applies to bf16 with head_dim 64 or 128 when every tensor is 16-byte
/// aligned (cp.async moves 16 bytes; views at odd offsets take the simple path).
bool use_tensor_cores(const AttentionShape& s, DType dtype,
                      std::initializer_list<const Tensor*> tensors) {
  if (dtype != DType::bf16 || (s.head_dim != 64 && s.head_dim != 128)) return false;
  for (const Tensor* t : tensors) {
    if (reinterpret_cast<uintptr_t>(t->raw_data()) % kFastAlignment != 0) return false;
  }
  return true;
}

const uint16_t* bf16_data(const Tensor& t) { return static_cast<const uint16_t*>(t.raw_data()); }
uint16_t* bf16_mutable(const Tensor& t) { return static_cast<uint16_t*>(t.raw_data()); }

/// Raises the kernel's dynamic shared memory limit (48 KiB by default) to `bytes`.
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes) {
  OCTET_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
}

template <int kD>
void forward_tensor_cores(const Tensor& qkv, const AttentionShape& s, const Tensor& out,
                          const Tensor& lse, float scale, cudaStream_t stream) {
  // Q, plus K and V double-buffered.
  constexpr size_t kSmem = 5 * kTile * (kD + kPad) * sizeof(uint16_t);
  allow_shared_memory(attention_forward_bf16_kernel<kD>, kSmem);
  attention_forward_bf16_kernel<kD><<<tile_grid(s), kFastThreads, kSmem, stream>>>(
      bf16_data(qkv), bf16_mutable(out), lse.data<float>(), static_cast<int>(s.seq),
      static_cast<int>(s.heads), scale * kLog2e);
  OCTET_CHECK_LAUNCH();
}

template <int kD>
void backward_tensor_cores(const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                           const Tensor& delta, const AttentionShape& s, const Tensor& dqkv,
                           float scale, cudaStream_t stream) {
  constexpr int kStep = backward_step<kD>();
  constexpr size_t kRow = (kD + kPad) * sizeof(uint16_t);
  // dK/dV: K and V, plus Q, dO and the row statistics double-buffered.
  constexpr size_t kDkdvSmem = (2 * kTile + 4 * kStep) * kRow + 4 * kStep * sizeof(float);
  // dQ: Q and dO, plus K and V double-buffered.
  constexpr size_t kDqSmem = (2 * kTile + 4 * kStep) * kRow;
  const int T = static_cast<int>(s.seq), H = static_cast<int>(s.heads);
  const dim3 grid = tile_grid(s);
  allow_shared_memory(attention_dkdv_bf16_kernel<kD>, kDkdvSmem);
  attention_dkdv_bf16_kernel<kD><<<grid, kFastThreads, kDkdvSmem, stream>>>(
      bf16_data(qkv), bf16_data(dout), lse.data<float>(), delta.data<float>(), bf16_mutable(dqkv),
      T, H, scale, scale * kLog2e);
  OCTET_CHECK_LAUNCH();
  allow_shared_memory(attention_dq_bf16_kernel<kD>, kDqSmem);
  attention_dq_bf16_kernel<kD><<<grid, kFastThreads, kDqSmem, stream>>>(
      bf16_data(qkv), bf16_data(dout), lse.data<float>(), delta.data<float>(), bf16_mutable(dqkv),
      T, H, scale, scale * kLog2e);
  OCTET_CHECK_LAUNCH();
}

template <typename Elem>
void forward_simple(const Tensor& qkv, const AttentionShape& s, const Tensor& out,
                    const Tensor& lse, float scale, cudaStream_t stream) {
  const int64_t rows = s.batch * s.heads * s.seq;
  attention_forward_simple_kernel<Elem>
      <<<grid_for(rows * kWarpSize, kSimpleThreads), kSimpleThreads, 0, stream>>>(
          static_cast<const Elem*>(qkv.raw_data()), static_cast<Elem*>(out.raw_data()),
          lse.data<float>(), rows, static_cast<int>(s.seq), static_cast<int>(s.heads),
          static_cast<int>(s.head_dim), scale);
  OCTET_CHECK_LAUNCH();
}

template <typename Elem>
void backward_simple(const Tensor& dout, const Tensor& qkv, const Tensor& lse, const Tensor& delta,
                     const AttentionShape& s, const Tensor& dqkv, float scale,
                     cudaStream_t stream) {
  const int64_t rows = s.batch * s.heads * s.seq;
  const unsigned int grid = grid_for(rows * kWarpSize, kSimpleThreads);
  const auto* x = static_cast<const Elem*>(qkv.raw_data());
  const auto* g = static_cast<const Elem*>(dout.raw_data());
  auto* dx = static_cast<Elem*>(dqkv.raw_data());
  const int T = static_cast<int>(s.seq), H = static_cast<int>(s.heads),
            D = static_cast<int>(s.head_dim);
  attention_dq_simple_kernel<Elem><<<grid, kSimpleThreads, 0, stream>>>(
      x, g, lse.data<float>(), delta.data<float>(), dx, rows, T, H, D, scale);
  OCTET_CHECK_LAUNCH();
  attention_dkdv_simple_kernel<Elem><<<grid, kSimpleThreads, 0, stream>>>(
      x, g, lse.data<float>(), delta.data<float>(), dx, rows, T, H, D, scale);
  OCTET_CHECK_LAUNCH();
}

template <typename Elem>
void compute_delta(const Tensor& dout, const Tensor& out, const Tensor& delta,
                   const AttentionShape& s, cudaStream_t stream) {
  const int64_t rows = s.batch * s.seq * s.heads;
  attention_delta_kernel<Elem>
      <<<grid_for(rows * kWarpSize, kSimpleThreads), kSimpleThreads, 0, stream>>>(
          static_cast<const Elem*>(dout.raw_data()), static_cast<const Elem*>(out.raw_data()),
          delta.data<float>(), rows, static_cast<int>(s.seq), static_cast<int>(s.heads),
          static_cast<int>(s.head_dim));
  OCTET_CHECK_LAUNCH();
}

template <typename Elem>
void rope_typed(const Tensor& qkv, const AttentionShape& s, float theta, bool inverse,
                cudaStream_t stream) {
  const int64_t pairs = s.batch * s.seq * 2 * s.heads * (s.head_dim / 2);
  rope_kernel<Elem><<<grid_for(pairs, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      static_cast<Elem*>(qkv.raw_data()), pairs, static_cast<int>(s.seq), static_cast<int>(s.heads),
      static_cast<int>(s.head_dim), theta, inverse);
  OCTET_CHECK_LAUNCH();
}

float softmax_scale(const AttentionShape& s) {
  return 1.0f / std::sqrt(static_cast<float>(s.head_dim));
}

}  // namespace

void attention_forward(const Tensor& qkv, const AttentionShape& shape, const Tensor& out,
                       const Tensor& lse) {
  check_cuda_shape(shape, "attention_forward");
  const Device device = qkv.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const float scale = softmax_scale(shape);
  if (use_tensor_cores(shape, qkv.dtype(), {&qkv, &out})) {
    if (shape.head_dim == 64) {
      forward_tensor_cores<64>(qkv, shape, out, lse, scale, stream);
    } else {
      forward_tensor_cores<128>(qkv, shape, out, lse, scale, stream);
    }
  } else if (qkv.dtype() == DType::bf16) {
    forward_simple<uint16_t>(qkv, shape, out, lse, scale, stream);
  } else {
    forward_simple<float>(qkv, shape, out, lse, scale, stream);
  }
}

void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                        const AttentionShape& shape, const Tensor& dqkv) {
  check_cuda_shape(shape, "attention_backward");
  const Device device = qkv.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const float scale = softmax_scale(shape);
  // Freed stream-ordered after the kernels that read it.
  const Tensor delta = Tensor::empty({shape.batch, shape.heads, shape.seq}, DType::f32, device);
  if (qkv.dtype() == DType::bf16) {
    compute_delta<uint16_t>(dout, out, delta, shape, stream);
  } else {
    compute_delta<float>(dout, out, delta, shape, stream);
  }
  if (use_tensor_cores(shape, qkv.dtype(), {&qkv, &dout, &dqkv})) {
    if (shape.head_dim == 64) {
      backward_tensor_cores<64>(dout, qkv, lse, delta, shape, dqkv, scale, stream);
    } else {
      backward_tensor_cores<128>(dout, qkv, lse, delta, shape, dqkv, scale, stream);
    }
  } else if (qkv.dtype() == DType::bf16) {
    backward_simple<uint16_t>(dout, qkv, lse, delta, shape, dqkv, scale, stream);
  } else {
    backward_simple<float>(dout, qkv, lse, delta, shape, dqkv, scale, stream);
  }
}

void rope(const Tensor& qkv, const AttentionShape& shape, float theta, bool inverse) {
  const Device device = qkv.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  if (qkv.dtype() == DType::bf16) {
    rope_typed<uint16_t>(qkv, shape, theta, inverse, stream);
  } else {
    rope_typed<float>(qkv, shape, theta, inverse, stream);
  }
}

}  // namespace octet::ops::cuda
