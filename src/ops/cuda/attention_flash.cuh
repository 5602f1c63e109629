// The bf16 tensor-core kernels of causal attention (flash-attention-2 style: forward, dK/dV and
// dQ; attention.cu's file comment has the whole design), templated on head_dim and on the m16 row
// blocks per warp, with their launchers. attention_flash.cu instantiates the tilings that
// ops::attention_* use; bench/attention_tilings.cu the others, kept for measurement.
//
// Everything here has internal linkage (an unnamed namespace), as in the .cu file it came from:
// each including file gets its own kernels, under the same names.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "octet/core/cuda_context.h"
#include "octet/fp8/format.h"
#include "octet/ops/attention.h"
#include "ops/cuda/launch_util.cuh"
#include "ops/cuda/mma_util.cuh"

namespace octet::ops::cuda {
namespace {

/// The fast kernels work in base 2 (exp2f is a single MUFU.EX2): scores are scaled by log2(e),
/// and lse converts back with ln(2).
constexpr float kLog2e = 1.44269504088896340736f;
constexpr float kLn2 = 0.69314718055994530942f;

constexpr int kFastWarps = 4;
constexpr int kFastThreads = kFastWarps * kWarpSize;
/// bf16 elements per 16-byte cp.async.
constexpr int kChunk = 8;

/// Tile sizes of the tensor-core kernels for head_dim kD with kM m16 row blocks per warp
/// (the tilings of bench/attention_tilings.h: rows16 is kM = 1, rows32 is kM = 2).
///
/// Why kM = 2: each B fragment a warp loads from shared memory (K or V in the forward, Q or dO in
/// dK/dV, K or V in dQ) feeds kM MMAs, one per row block. With kM = 1 every m16n8k16 MMA (4096
/// MACs) needs 256 bytes of ldmatrix traffic, and the SM's 128 bytes/clock of shared memory
/// bandwidth then caps mma.sync near its own rate; kM = 2 halves that. The price is registers:
/// the f32 accumulators double, which is why kM = 2 is for head_dim 64 only.
///
/// The streamed steps keep each kernel's live f32 tiles within the 255 registers of a thread
/// (counts per thread: a 16 x n f32 tile per warp is n/2 registers):
/// - forward: O (kM*16 x kD) + S (kM*16 x kKeys): 32+32 (kM=1, D=64), 64+32 (D=128), 64+64
///   (kM=2), plus the Q fragments (kM*16 x kD bf16: 16, 32, 32);
/// - dK/dV: dK + dV (2 x kM*16 x kD) + S^T + dP^T (2 x kM*16 x kDkdvStep): 64+32 (kM=1, D=64,
///   step 64), 128+16 (D=128, step 32), 128+64 (kM=2, step 32); K and V fragments are reloaded
///   from shared memory every step;
/// - dQ: dQ + S + dP plus the Q and dO fragments held for the whole kernel: 32+64+32 (kM=1,
///   D=64, step 64), 64+32+64 (D=128, step 32), 64+64+64 (kM=2, step 32).
template <int kD, int kM>
struct FastTiles {
  static_assert(kD == 64 || kD == 128, "tiles and register use are sized for head_dim 64 and 128");
  static_assert(kM == 1 || (kM == 2 && kD == 64),
                "two row blocks per warp fit the register budget at head_dim 64 only");
  /// Rows a warp owns, and a CTA: queries in the forward and dQ kernels, keys in dK/dV.
  static constexpr int kWarpRows = kM * kMmaM;
  static constexpr int kCtaRows = kFastWarps * kWarpRows;
  /// Keys per step of the forward (FlashAttention-2's kBlockN for head_dim 64 and 128).
  static constexpr int kKeys = 64;
  /// Queries per step of the dK/dV kernel and keys per step of the dQ kernel.
  static constexpr int kDkdvStep = (kM == 1 && kD == 64) ? 64 : 32;
  static constexpr int kDqStep = kDkdvStep;
  static constexpr int kStride = kD + kPad;
  static constexpr size_t kRowBytes = kStride * sizeof(uint16_t);
  /// Dynamic shared memory: forward Q + double-buffered K and V; dK/dV K and V + double-buffered
  /// Q, dO and the row statistics (lse, delta); dQ Q and dO + double-buffered K and V.
  static constexpr size_t kForwardSmem = (kCtaRows + 4 * kKeys) * kRowBytes;
  static constexpr size_t kDkdvSmem =
      (2 * kCtaRows + 4 * kDkdvStep) * kRowBytes + 4 * kDkdvStep * sizeof(float);
  static constexpr size_t kDqSmem = (2 * kCtaRows + 4 * kDqStep) * kRowBytes;
  static_assert(kKeys % (2 * kMmaN) == 0 && kDkdvStep % (2 * kMmaN) == 0 &&
                    kDqStep % (2 * kMmaN) == 0 && kD % (2 * kMmaN) == 0,
                "B fragments are loaded in pairs of n8 tiles (ldmatrix.x4)");
  static_assert(kCtaRows % kDkdvStep == 0, "dK/dV query steps start on key-tile boundaries");
  static_assert(kDkdvStep <= kFastThreads, "one thread per query loads the row statistics");
};

// ----------------------------------------------------------------------------
// Tiles in and out of shared memory

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
          fp8::encode_bf16x2(acc[nt][0] * mul_lo, acc[nt][1] * mul_lo);
    }
    if (g + 8 < valid) {
      *reinterpret_cast<uint32_t*>(dst + (g + 8) * stride + col) =
          fp8::encode_bf16x2(acc[nt][2] * mul_hi, acc[nt][3] * mul_hi);
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

/// Forward. Grid (B*H, ceil(T/kCtaRows)); the CTA owns queries [q0, q0 + kCtaRows) of one head
/// and streams key tiles of kKeys up to the diagonal. Query tiles run from the last (most work)
/// to the first, for a balanced tail. A warp skips the key tiles past its last row and masks only
/// those that cross its rows' diagonal.
template <int kD, int kM>
__global__ void __launch_bounds__(kFastThreads)
    attention_forward_bf16_kernel(const uint16_t* __restrict__ qkv, uint16_t* __restrict__ out,
                                  float* __restrict__ lse, int T, int H, float scale_log2) {
  using Tiles = FastTiles<kD, kM>;
  constexpr int kRows = Tiles::kCtaRows, kKeys = Tiles::kKeys, kStride = Tiles::kStride;
  constexpr int kKeyElems = kKeys * kStride;
  uint16_t* q_s = shared_bf16();          // [kRows][kStride]
  uint16_t* k_s = q_s + kRows * kStride;  // [2][kKeys][kStride]
  uint16_t* v_s = k_s + 2 * kKeyElems;    // [2][kKeys][kStride]

  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kRows;
  const int64_t stride = 3LL * H * kD;
  const uint16_t* q_g = qkv + static_cast<int64_t>(b) * T * stride + static_cast<int64_t>(h) * kD;
  const uint16_t* k_g = q_g + static_cast<int64_t>(H) * kD;
  const uint16_t* v_g = k_g + static_cast<int64_t>(H) * kD;

  load_tile<kRows, kD>(q_s, q_g + q0 * stride, stride, T - q0);
  cp_async_commit();
  load_tile<kKeys, kD>(k_s, k_g, stride, T);
  load_tile<kKeys, kD>(v_s, v_g, stride, T);
  cp_async_commit();

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, t = lane % 4;
  const int first = q0 + warp * Tiles::kWarpRows;  // the warp's first query row
  const int last = first + Tiles::kWarpRows - 1;
  const int row0 = first + lane / 4;  // this thread's rows: row0 + 16 * mi + 8 * r
  cp_async_wait<1>();                 // Q has landed
  __syncthreads();
  uint32_t qf[kM][kD / kMmaK][4];
  load_a<kM, kD>(qf, q_s + warp * Tiles::kWarpRows * kStride);

  float o[kM][kD / kMmaN][4] = {};
  float m[kM][2], l[kM][2];  // running max of the base-2 scores; sum of exp2(score - m)
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m[mi][r] = -INFINITY;
      l[mi][r] = 0.0f;  // this thread's columns only, until the final quad sum
    }
  }
  const int tiles = (min(q0 + kRows, T) + kKeys - 1) / kKeys;
  for (int kt = 0; kt < tiles; ++kt) {
    const int buf = kt & 1;
    // Tile kt has landed, and every warp is done with tile kt-1, whose buffer is refilled next.
    cp_async_wait<0>();
    __syncthreads();
    if (kt + 1 < tiles) {
      const int next = (kt + 1) * kKeys;
      load_tile<kKeys, kD>(k_s + (buf ^ 1) * kKeyElems, k_g + next * stride, stride, T - next);
      load_tile<kKeys, kD>(v_s + (buf ^ 1) * kKeyElems, v_g + next * stride, stride, T - next);
      cp_async_commit();
    }
    const int k0 = kt * kKeys;
    if (k0 > last) continue;  // every key is after every row of this warp: all masked

    float s[kM][kKeys / kMmaN][4] = {};
    mma_abt<kM, kKeys, kD>(s, qf, k_s + buf * kKeyElems);
    // Keys past T only occur in tiles that cross the diagonal (T > every valid row).
    const bool diagonal = k0 + kKeys - 1 > first;
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + kMmaM * mi + 8 * r;
        float tile_max = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kKeys / kMmaN; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = k0 + nt * kMmaN + 2 * t + e;
            float& x = s[mi][nt][2 * r + e];
            x = (diagonal && key > row) ? -INFINITY : x * scale_log2;
            tile_max = fmaxf(tile_max, x);
          }
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
        const float m_new = fmaxf(m[mi][r], tile_max);
        // Key 0 (tile 0, never skipped) is never masked, so m_new is finite; the guard keeps
        // -inf - -inf (NaN) out anyway.
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = exp2f(m[mi][r] - m_use);
        m[mi][r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kKeys / kMmaN; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[mi][nt][2 * r + e];
            x = exp2f(x - m_use);
            sum += x;
          }
        }
        l[mi][r] = l[mi][r] * alpha + sum;
#pragma unroll
        for (int nt = 0; nt < kD / kMmaN; ++nt) {
          o[mi][nt][2 * r] *= alpha;
          o[mi][nt][2 * r + 1] *= alpha;
        }
      }
    }
    uint32_t pf[kM][kKeys / kMmaK][4];
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) c_to_a<kKeys>(s[mi], pf[mi]);
    mma_ab<kM, kKeys, kD>(o, pf, v_s + buf * kKeyElems);
  }

  const int64_t out_stride = static_cast<int64_t>(H) * kD;
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
    // Each row's sum is spread over the 4 lanes of its quad.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[mi][r] += __shfl_xor_sync(kFullMask, l[mi][r], 1);
      l[mi][r] += __shfl_xor_sync(kFullMask, l[mi][r], 2);
    }
    const int block = first + kMmaM * mi;
    store_rows<kD>(o[mi], out + (static_cast<int64_t>(b) * T + block) * out_stride + h * kD,
                   out_stride, T - block, 1.0f / l[mi][0], 1.0f / l[mi][1]);
    if (t == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + kMmaM * mi + 8 * r;
        if (row < T) lse[static_cast<int64_t>(bh) * T + row] = m[mi][r] * kLn2 + logf(l[mi][r]);
      }
    }
  }
}

/// dK and dV. Grid (B*H, ceil(T/kCtaRows)); the CTA owns keys [k0, k0 + kCtaRows) of one head
/// and streams the queries from k0 on in steps of kDkdvStep: S^T = K Q^T, P^T = exp2(S^T - lse),
/// dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q. A warp skips the steps
/// before its first key (all masked) and masks only the step that crosses its diagonal and the
/// one past T.
template <int kD, int kM>
__global__ void __launch_bounds__(kFastThreads)
    attention_dkdv_bf16_kernel(const uint16_t* __restrict__ qkv, const uint16_t* __restrict__ dout,
                               const float* __restrict__ lse, const float* __restrict__ delta,
                               uint16_t* __restrict__ dqkv, int T, int H, float scale,
                               float scale_log2) {
  using Tiles = FastTiles<kD, kM>;
  constexpr int kRows = Tiles::kCtaRows, kStep = Tiles::kDkdvStep, kStride = Tiles::kStride;
  constexpr int kStepElems = kStep * kStride;
  uint16_t* k_s = shared_bf16();                                   // [kRows][kStride]
  uint16_t* v_s = k_s + kRows * kStride;                           // [kRows][kStride]
  uint16_t* q_s = v_s + kRows * kStride;                           // [2][kStep][kStride]
  uint16_t* do_s = q_s + 2 * kStepElems;                           // [2][kStep][kStride]
  float* lse_s = reinterpret_cast<float*>(do_s + 2 * kStepElems);  // [2][kStep], base 2
  float* delta_s = lse_s + 2 * kStep;                              // [2][kStep]

  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int k0 = blockIdx.y * kRows;  // key tile 0 has the most queries and starts first
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
  load_tile<kRows, kD>(k_s, k_g + k0 * stride, stride, T - k0);
  load_tile<kRows, kD>(v_s, v_g + k0 * stride, stride, T - k0);
  load_queries(k0, 0);
  cp_async_commit();

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, t = lane % 4;
  const int first = k0 + warp * Tiles::kWarpRows;  // the warp's first key
  const int key0 = first + lane / 4;               // this thread's keys: key0 + 16 * mi + 8 * r
  const uint16_t* k_warp = k_s + warp * Tiles::kWarpRows * kStride;
  const uint16_t* v_warp = v_s + warp * Tiles::kWarpRows * kStride;
  const int steps = (T - k0 + kStep - 1) / kStep;
  float dk[kM][kD / kMmaN][4] = {};
  float dv[kM][kD / kMmaN][4] = {};
  for (int j = 0; j < steps; ++j) {
    const int buf = j & 1, q0 = k0 + j * kStep;
    cp_async_wait<0>();
    __syncthreads();
    if (j + 1 < steps) {
      load_queries(q0 + kStep, buf ^ 1);
      cp_async_commit();
    }
    if (q0 + kStep <= first) continue;  // every query is before every key of this warp
    const uint16_t* qb = q_s + buf * kStepElems;
    const uint16_t* dob = do_s + buf * kStepElems;
    const float* lse_b = lse_s + buf * kStep;
    const float* delta_b = delta_s + buf * kStep;

    float st[kM][kStep / kMmaN][4] = {};  // S^T, then P^T: the warp's keys x kStep queries
    mma_abt_from_shared<kM, kStep, kD>(st, k_warp, qb);
    const bool masked = q0 < first + Tiles::kWarpRows - 1 || q0 + kStep > T;
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
      for (int nt = 0; nt < kStep / kMmaN; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = nt * kMmaN + 2 * t + (e & 1);  // query within the step
          const int key = key0 + kMmaM * mi + (e >= 2 ? 8 : 0);
          float p = exp2f(st[mi][nt][e] * scale_log2 - lse_b[qi]);
          if (masked && (key > q0 + qi || q0 + qi >= T)) p = 0.0f;
          st[mi][nt][e] = p;
        }
      }
    }
    {  // dV first: its bf16 P^T fragments are dead before dP^T needs registers
      uint32_t pf[kM][kStep / kMmaK][4];
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) c_to_a<kStep>(st[mi], pf[mi]);
      mma_ab<kM, kStep, kD>(dv, pf, dob);
    }
    float dpt[kM][kStep / kMmaN][4] = {};  // dP^T, then dS^T
    mma_abt_from_shared<kM, kStep, kD>(dpt, v_warp, dob);
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
      for (int nt = 0; nt < kStep / kMmaN; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = nt * kMmaN + 2 * t + (e & 1);
          dpt[mi][nt][e] = st[mi][nt][e] * (dpt[mi][nt][e] - delta_b[qi]);
        }
      }
    }
    uint32_t dsf[kM][kStep / kMmaK][4];
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) c_to_a<kStep>(dpt[mi], dsf[mi]);
    mma_ab<kM, kStep, kD>(dk, dsf, qb);
  }

#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
    const int block = first + kMmaM * mi;
    uint16_t* dk_g = dqkv + (static_cast<int64_t>(b) * T + block) * stride + out_stride +
                     static_cast<int64_t>(h) * kD;
    store_rows<kD>(dk[mi], dk_g, stride, T - block, scale, scale);
    store_rows<kD>(dv[mi], dk_g + out_stride, stride, T - block, 1.0f, 1.0f);
  }
}

/// dQ. Grid (B*H, ceil(T/kCtaRows)); the CTA owns queries [q0, q0 + kCtaRows) of one head and
/// streams the keys up to the diagonal in steps of kDqStep: S = Q K^T, dP = dO V^T,
/// dS = P (dP - delta), dQ += dS K. Query tiles run from the last (most work) to the first. A
/// warp skips the steps past its last row and masks only those that cross its diagonal or T.
template <int kD, int kM>
__global__ void __launch_bounds__(kFastThreads)
    attention_dq_bf16_kernel(const uint16_t* __restrict__ qkv, const uint16_t* __restrict__ dout,
                             const float* __restrict__ lse, const float* __restrict__ delta,
                             uint16_t* __restrict__ dqkv, int T, int H, float scale,
                             float scale_log2) {
  using Tiles = FastTiles<kD, kM>;
  constexpr int kRows = Tiles::kCtaRows, kStep = Tiles::kDqStep, kStride = Tiles::kStride;
  constexpr int kStepElems = kStep * kStride;
  uint16_t* q_s = shared_bf16();           // [kRows][kStride]
  uint16_t* do_s = q_s + kRows * kStride;  // [kRows][kStride]
  uint16_t* k_s = do_s + kRows * kStride;  // [2][kStep][kStride]
  uint16_t* v_s = k_s + 2 * kStepElems;    // [2][kStep][kStride]

  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kRows;
  const int64_t stride = 3LL * H * kD, out_stride = static_cast<int64_t>(H) * kD;
  const uint16_t* q_g = qkv + static_cast<int64_t>(b) * T * stride + static_cast<int64_t>(h) * kD;
  const uint16_t* k_g = q_g + out_stride;
  const uint16_t* v_g = k_g + out_stride;
  const uint16_t* do_g =
      dout + static_cast<int64_t>(b) * T * out_stride + static_cast<int64_t>(h) * kD;

  load_tile<kRows, kD>(q_s, q_g + q0 * stride, stride, T - q0);
  load_tile<kRows, kD>(do_s, do_g + q0 * out_stride, out_stride, T - q0);
  cp_async_commit();
  load_tile<kStep, kD>(k_s, k_g, stride, T);
  load_tile<kStep, kD>(v_s, v_g, stride, T);
  cp_async_commit();

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, t = lane % 4;
  const int first = q0 + warp * Tiles::kWarpRows;  // the warp's first query row
  const int last = first + Tiles::kWarpRows - 1;
  const int row0 = first + lane / 4;  // this thread's rows: row0 + 16 * mi + 8 * r
  float lse2[kM][2], row_delta[kM][2];
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + kMmaM * mi + 8 * r;
      // Past the end, lse = +inf makes P = 0.
      lse2[mi][r] = row < T ? lse[static_cast<int64_t>(bh) * T + row] * kLog2e : INFINITY;
      row_delta[mi][r] = row < T ? delta[static_cast<int64_t>(bh) * T + row] : 0.0f;
    }
  }
  cp_async_wait<1>();  // Q and dO have landed
  __syncthreads();
  uint32_t qf[kM][kD / kMmaK][4], dof[kM][kD / kMmaK][4];
  load_a<kM, kD>(qf, q_s + warp * Tiles::kWarpRows * kStride);
  load_a<kM, kD>(dof, do_s + warp * Tiles::kWarpRows * kStride);

  const int keys = min(q0 + kRows, T);
  const int steps = (keys + kStep - 1) / kStep;
  float dq[kM][kD / kMmaN][4] = {};
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
    if (k0 > last) continue;  // every key is after every row of this warp
    const uint16_t* kb = k_s + buf * kStepElems;
    const uint16_t* vb = v_s + buf * kStepElems;

    float s[kM][kStep / kMmaN][4] = {};
    float dp[kM][kStep / kMmaN][4] = {};
    mma_abt<kM, kStep, kD>(s, qf, kb);
    mma_abt<kM, kStep, kD>(dp, dof, vb);
    const bool masked = k0 + kStep - 1 > first || k0 + kStep > T;
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
      for (int nt = 0; nt < kStep / kMmaN; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2;
          const int key = k0 + nt * kMmaN + 2 * t + (e & 1);
          float p = exp2f(s[mi][nt][e] * scale_log2 - lse2[mi][r]);
          if (masked && key > row0 + kMmaM * mi + 8 * r) p = 0.0f;
          s[mi][nt][e] = p * (dp[mi][nt][e] - row_delta[mi][r]);  // dS
        }
      }
    }
    uint32_t dsf[kM][kStep / kMmaK][4];
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) c_to_a<kStep>(s[mi], dsf[mi]);
    mma_ab<kM, kStep, kD>(dq, dsf, kb);
  }

#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
    const int block = first + kMmaM * mi;
    store_rows<kD>(dq[mi], dqkv + (static_cast<int64_t>(b) * T + block) * stride + h * kD, stride,
                   T - block, scale, scale);
  }
}

// ----------------------------------------------------------------------------
// Launchers

/// The 2-D grid of the tensor-core kernels: (B*H, ceil(T/rows)) for CTAs of `rows` rows.
dim3 tile_grid(const AttentionShape& s, int rows) {
  const int64_t heads = s.batch * s.heads, tiles = ceil_div(s.seq, rows);
  OCTET_CHECK(heads <= INT32_MAX && tiles <= kMaxGridY, "attention: batch*heads = ", heads,
              " must be <= ", INT32_MAX, " and ceil(seq/", rows, ") = ", tiles, " <= ", kMaxGridY);
  return dim3(static_cast<unsigned int>(heads), static_cast<unsigned int>(tiles));
}

const uint16_t* bf16_data(const Tensor& t) { return static_cast<const uint16_t*>(t.raw_data()); }
uint16_t* bf16_mutable(const Tensor& t) { return static_cast<uint16_t*>(t.raw_data()); }

/// Raises the kernel's dynamic shared memory limit (48 KiB by default) to `bytes`.
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes) {
  OCTET_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
}

template <int kD, int kM>
void forward_tensor_cores(const Tensor& qkv, const AttentionShape& s, const Tensor& out,
                          const Tensor& lse, float scale, cudaStream_t stream) {
  using Tiles = FastTiles<kD, kM>;
  allow_shared_memory(attention_forward_bf16_kernel<kD, kM>, Tiles::kForwardSmem);
  attention_forward_bf16_kernel<kD, kM>
      <<<tile_grid(s, Tiles::kCtaRows), kFastThreads, Tiles::kForwardSmem, stream>>>(
          bf16_data(qkv), bf16_mutable(out), lse.data<float>(), static_cast<int>(s.seq),
          static_cast<int>(s.heads), scale * kLog2e);
  OCTET_CHECK_LAUNCH();
}

/// The dK/dV kernel with kMKv row blocks per warp, then the dQ kernel with kMQ.
template <int kD, int kMKv, int kMQ>
void backward_tensor_cores(const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                           const Tensor& delta, const AttentionShape& s, const Tensor& dqkv,
                           float scale, cudaStream_t stream) {
  using KvTiles = FastTiles<kD, kMKv>;
  using QTiles = FastTiles<kD, kMQ>;
  const int T = static_cast<int>(s.seq), H = static_cast<int>(s.heads);
  allow_shared_memory(attention_dkdv_bf16_kernel<kD, kMKv>, KvTiles::kDkdvSmem);
  attention_dkdv_bf16_kernel<kD, kMKv>
      <<<tile_grid(s, KvTiles::kCtaRows), kFastThreads, KvTiles::kDkdvSmem, stream>>>(
          bf16_data(qkv), bf16_data(dout), lse.data<float>(), delta.data<float>(),
          bf16_mutable(dqkv), T, H, scale, scale * kLog2e);
  OCTET_CHECK_LAUNCH();
  allow_shared_memory(attention_dq_bf16_kernel<kD, kMQ>, QTiles::kDqSmem);
  attention_dq_bf16_kernel<kD, kMQ>
      <<<tile_grid(s, QTiles::kCtaRows), kFastThreads, QTiles::kDqSmem, stream>>>(
          bf16_data(qkv), bf16_data(dout), lse.data<float>(), delta.data<float>(),
          bf16_mutable(dqkv), T, H, scale, scale * kLog2e);
  OCTET_CHECK_LAUNCH();
}
}  // namespace
}  // namespace octet::ops::cuda
