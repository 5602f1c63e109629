// CUDA causal attention (forward and backward) and RoPE.
//
// Two paths compute the same function (the CPU reference in src/ops/cpu/attention.cc):
// - bf16 with head_dim 64 or 128 and 16-byte aligned tensors: flash-attention-2 style kernels on
//   BF16 tensor cores (mma.sync.m16n8k16, f32 accumulation). A CTA of 4 warps owns 16 or 32
//   rows per warp (queries, or keys in the dK/dV kernel; FastTiles and AttentionTiling say which
//   kernel uses which, and why), and every fragment a warp loads from shared memory (ldmatrix)
//   feeds all of its row blocks; the other operand streams through
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
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "octet/core/cuda_context.h"
#include "octet/fp8/format.h"
#include "ops/attention_backend.h"
#include "ops/cuda/attention_tiling.h"
#include "ops/cuda/launch_util.cuh"

namespace octet::ops::cuda {
namespace {

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
/// Shared-memory rows are padded by 8 bf16 (16 bytes): rows stay 16-byte aligned for cp.async and
/// ldmatrix, and consecutive rows start 4 banks apart (row stride = 4 mod 32 words for head_dim 64
/// and 128), so the 8 rows x 16 bytes of each ldmatrix phase hit 32 distinct banks.
constexpr int kPad = 8;
/// bf16 elements per 16-byte cp.async.
constexpr int kChunk = 8;
constexpr uintptr_t kFastAlignment = 16;

/// Tile sizes of the tensor-core kernels for head_dim kD with kM m16 row blocks per warp
/// (AttentionTiling: kRows16 is kM = 1, kRows32 is kM = 2).
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

/// Four 8x8 bf16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i,
/// and lane l receives elements 2*(l%4), 2*(l%4)+1 of row l/4 of each matrix.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p))
               : "memory");
}

/// Four 8x8 bf16 matrices from shared memory, transposed: lanes 8i..8i+7 give the row addresses
/// of matrix i, and lane l receives rows 2*(l%4), 2*(l%4)+1 of column l/4 of each matrix.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p))
               : "memory");
}

// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating
// point type"), with g = lane / 4 and t = lane % 4:
// - A (16x16, row-major), 4 words of 2 bf16: {row g, cols 2t..2t+1}, {row g+8, cols 2t..},
//   {row g, cols 2t+8..}, {row g+8, cols 2t+8..};
// - B (16x8, "col"), 2 words: {rows 2t..2t+1, col g}, {rows 2t+8..2t+9, col g};
// - C (16x8, f32), 4 floats: {row g, cols 2t, 2t+1}, {row g+8, cols 2t, 2t+1}.
// Two adjacent C tiles (cols 0-7, 8-15) of the same rows therefore hold exactly the A fragment
// of those 16 columns, which is how P and dS feed the next product without shared memory.

/// A fragments of kM row blocks (16 rows each) x columns [kc*16, kc*16 + 16) stored at `rows`
/// (row stride kK + kPad), by ldmatrix: lanes 0-15 address rows 0-15 at column kc*16 (matrices
/// 0, 1: rows g and g+8 of the first 8 columns), lanes 16-31 the same rows 8 columns on
/// (matrices 2, 3).
template <int kM, int kK>
__device__ __forceinline__ void load_a_chunk(uint32_t (&a)[kM][4], const uint16_t* rows, int kc) {
  constexpr int kStride = kK + kPad;
  const int lane = threadIdx.x % kWarpSize;
  const uint16_t* p = rows + (lane % 16) * kStride + lane / 16 * 8 + kc * kMmaK;
#pragma unroll
  for (int m = 0; m < kM; ++m) ldmatrix_x4(a[m], p + m * kMmaM * kStride);
}

/// A fragments of kM row blocks x all kK columns stored at `rows` (see load_a_chunk). The two
/// spellings are the same loads; ptxas fits each kernel in 255 registers without spills with
/// one of them only (checked with -Xptxas -v), hence the choice by kM.
template <int kM, int kK>
__device__ __forceinline__ void load_a(uint32_t (&a)[kM][kK / kMmaK][4], const uint16_t* rows) {
  if constexpr (kM == 1) {
    constexpr int kStride = kK + kPad;
    const int lane = threadIdx.x % kWarpSize;
    const uint16_t* p = rows + (lane % 16) * kStride + lane / 16 * 8;
#pragma unroll
    for (int kc = 0; kc < kK / kMmaK; ++kc) ldmatrix_x4(a[0][kc], p + kc * kMmaK);
  } else {
#pragma unroll
    for (int kc = 0; kc < kK / kMmaK; ++kc) {
      uint32_t chunk[kM][4];
      load_a_chunk<kM, kK>(chunk, rows, kc);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[m][kc][i] = chunk[m][i];
      }
    }
  }
}

/// acc += A B^T as mma_abt, with A (kM row blocks at `a_rows`, row stride kK + kPad) read from
/// shared memory: whole into registers for one row block, one 16-column chunk at a time for
/// two, whose accumulators leave no room for all of A. (Chosen by what ptxas fits in 255
/// registers without spilling in the dK/dV kernel.)
template <int kM, int kN, int kK>
__device__ __forceinline__ void mma_abt_from_shared(float (&acc)[kM][kN / kMmaN][4],
                                                    const uint16_t* a_rows, const uint16_t* b);

/// acc (kM*16 x kN) += A (kM*16 x kK) * B^T, where B is kN rows of kK in shared memory (row
/// stride kK + kPad): the "rows times rows" product, e.g. S = Q K^T. B's fragment {rows 2t..,
/// col g} of B^T is two consecutive elements of B's row g, so plain ldmatrix gives it: lanes 0-7
/// address rows 0-7 at column kc*16, lanes 8-15 the same rows at column kc*16 + 8 ({b0, b1} of
/// n-tile 2np), lanes 16-31 rows 8-15 likewise (n-tile 2np+1). Each fragment feeds kM MMAs.
template <int kM, int kN, int kK>
__device__ __forceinline__ void mma_abt(float (&acc)[kM][kN / kMmaN][4],
                                        const uint32_t (&a)[kM][kK / kMmaK][4], const uint16_t* b) {
  constexpr int kStride = kK + kPad;
  const int lane = threadIdx.x % kWarpSize;
  const uint16_t* p = b + (lane / 16 * kMmaN + lane % 8) * kStride + lane / 8 % 2 * 8;
#pragma unroll
  for (int np = 0; np < kN / (2 * kMmaN); ++np) {
#pragma unroll
    for (int kc = 0; kc < kK / kMmaK; ++kc) {
      uint32_t f[4];
      ldmatrix_x4(f, p + np * 2 * kMmaN * kStride + kc * kMmaK);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        mma_bf16(acc[m][2 * np], a[m][kc], f[0], f[1]);
        mma_bf16(acc[m][2 * np + 1], a[m][kc], f[2], f[3]);
      }
    }
  }
}

/// mma_abt with A read from shared memory (rows at `a_rows`, stride kK + kPad) one 16-column
/// chunk at a time, for kernels whose registers cannot hold all of A next to their accumulators.
template <int kM, int kN, int kK>
__device__ __forceinline__ void mma_abt_shared_a(float (&acc)[kM][kN / kMmaN][4],
                                                 const uint16_t* a_rows, const uint16_t* b) {
  constexpr int kStride = kK + kPad;
  const int lane = threadIdx.x % kWarpSize;
  const uint16_t* p = b + (lane / 16 * kMmaN + lane % 8) * kStride + lane / 8 % 2 * 8;
#pragma unroll
  for (int kc = 0; kc < kK / kMmaK; ++kc) {
    uint32_t a[kM][4];
    load_a_chunk<kM, kK>(a, a_rows, kc);
#pragma unroll
    for (int np = 0; np < kN / (2 * kMmaN); ++np) {
      uint32_t f[4];
      ldmatrix_x4(f, p + np * 2 * kMmaN * kStride + kc * kMmaK);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        mma_bf16(acc[m][2 * np], a[m], f[0], f[1]);
        mma_bf16(acc[m][2 * np + 1], a[m], f[2], f[3]);
      }
    }
  }
}

template <int kM, int kN, int kK>
__device__ __forceinline__ void mma_abt_from_shared(float (&acc)[kM][kN / kMmaN][4],
                                                    const uint16_t* a_rows, const uint16_t* b) {
  if constexpr (kM == 1) {
    uint32_t a[kM][kK / kMmaK][4];
    load_a<kM, kK>(a, a_rows);
    mma_abt<kM, kN, kK>(acc, a, b);
  } else {
    mma_abt_shared_a<kM, kN, kK>(acc, a_rows, b);
  }
}

/// acc (kM*16 x kN) += A (kM*16 x kK) * B, where B is kK rows of kN in shared memory (row stride
/// kN + kPad): e.g. O += P V. B's fragments need two elements of one column, so they come
/// through ldmatrix.trans: lanes 0-15 address rows kc*16 + 0..15 at column np*16, lanes 16-31
/// the same rows at column np*16 + 8, giving {b0, b1} of n-tiles 2np and 2np+1. Each fragment
/// feeds kM MMAs.
template <int kM, int kK, int kN>
__device__ __forceinline__ void mma_ab(float (&acc)[kM][kN / kMmaN][4],
                                       const uint32_t (&a)[kM][kK / kMmaK][4], const uint16_t* b) {
  constexpr int kStride = kN + kPad;
  const int lane = threadIdx.x % kWarpSize;
  const uint16_t* p = b + (lane % 16) * kStride + lane / 16 * kMmaN;
#pragma unroll
  for (int kc = 0; kc < kK / kMmaK; ++kc) {
#pragma unroll
    for (int np = 0; np < kN / (2 * kMmaN); ++np) {
      uint32_t f[4];
      ldmatrix_x4_trans(f, p + kc * kMmaK * kStride + np * 2 * kMmaN);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        mma_bf16(acc[m][2 * np], a[m][kc], f[0], f[1]);
        mma_bf16(acc[m][2 * np + 1], a[m][kc], f[2], f[3]);
      }
    }
  }
}

/// The f32 C fragments of a 16 x kN tile, rounded to bf16, as A fragments over its kN columns.
template <int kN>
__device__ __forceinline__ void c_to_a(const float (&c)[kN / kMmaN][4],
                                       uint32_t (&a)[kN / kMmaK][4]) {
#pragma unroll
  for (int kc = 0; kc < kN / kMmaK; ++kc) {
    a[kc][0] = fp8::encode_bf16x2(c[2 * kc][0], c[2 * kc][1]);
    a[kc][1] = fp8::encode_bf16x2(c[2 * kc][2], c[2 * kc][3]);
    a[kc][2] = fp8::encode_bf16x2(c[2 * kc + 1][0], c[2 * kc + 1][1]);
    a[kc][3] = fp8::encode_bf16x2(c[2 * kc + 1][2], c[2 * kc + 1][3]);
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

/// The delta kernel's fast form, for bf16 with head_dim a multiple of 8 up to 256 and 16-byte
/// aligned rows: each thread reads 8 elements of dout and of out (one 16-byte load each), so
/// lanes = head_dim / 8 consecutive lanes (a power of two) hold one (token, head). A lane sums its
/// 8 products in order, then a butterfly over those lanes adds the lanes' sums (a fixed order). The
/// warp-per-(token, head) form above issues 2-byte loads with 2 elements per lane at head_dim
/// 64, which measured 48 us per GPT-2 1.5B layer (dram 25% of peak) for 52 MB.
__global__ void __launch_bounds__(kElementwiseThreads)
    attention_delta_bf16_kernel(const uint16_t* __restrict__ dout, const uint16_t* __restrict__ out,
                                float* __restrict__ delta, int64_t rows, int T, int H, int lanes) {
  constexpr int kElems = 8;  // bf16 per 16-byte load
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t w = thread / lanes;  // (token, head), token-major like the tensors
  if (w >= rows) return;             // whole groups leave together (rows * lanes threads)
  const int sub = static_cast<int>(thread % lanes);
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  const unsigned group_mask = (lanes == kWarpSize ? kFullMask : ((1u << lanes) - 1u))
                              << (lane & ~(lanes - 1));
  const int64_t offset = (w * lanes + sub) * kElems;  // [token, h, d] with d contiguous
  const uint4 g = *reinterpret_cast<const uint4*>(dout + offset);
  const uint4 o = *reinterpret_cast<const uint4*>(out + offset);
  const uint32_t gw[4] = {g.x, g.y, g.z, g.w}, ow[4] = {o.x, o.y, o.z, o.w};
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // bf16 pairs: the low half is the lower address
    sum += __uint_as_float(gw[k] << 16) * __uint_as_float(ow[k] << 16);
    sum += __uint_as_float(gw[k] & 0xFFFF0000u) * __uint_as_float(ow[k] & 0xFFFF0000u);
  }
  for (int step = lanes / 2; step > 0; step /= 2) sum += __shfl_xor_sync(group_mask, sum, step);
  if (sub == 0) {
    const int64_t token = w / H;
    const int h = static_cast<int>(w % H);
    delta[((token / T) * H + h) * T + token % T] = sum;
  }
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

/// Blocks of `threads` for `work_threads` threads in a 1-D grid.
unsigned int grid_for(int64_t work_threads, int threads) {
  const int64_t blocks = ceil_div(work_threads, threads);
  OCTET_CHECK(blocks <= INT32_MAX, "attention kernel over ", work_threads,
              " threads exceeds the 1-D grid limit");
  return static_cast<unsigned int>(blocks);
}

/// The 2-D grid of the tensor-core kernels: (B*H, ceil(T/rows)) for CTAs of `rows` rows.
dim3 tile_grid(const AttentionShape& s, int rows) {
  const int64_t heads = s.batch * s.heads, tiles = ceil_div(s.seq, rows);
  OCTET_CHECK(heads <= INT32_MAX && tiles <= kMaxGridY, "attention: batch*heads = ", heads,
              " must be <= ", INT32_MAX, " and ceil(seq/", rows, ") = ", tiles, " <= ", kMaxGridY);
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

/// The tensor-core forward with `tiling` (head_dim 64 or 128; only kRows16 at 128).
void forward_tiled(const Tensor& qkv, const AttentionShape& s, const Tensor& out, const Tensor& lse,
                   AttentionTiling tiling, float scale, cudaStream_t stream) {
  if (s.head_dim == 128) {
    forward_tensor_cores<128, 1>(qkv, s, out, lse, scale, stream);
  } else if (tiling == AttentionTiling::kRows16) {
    forward_tensor_cores<64, 1>(qkv, s, out, lse, scale, stream);
  } else {
    forward_tensor_cores<64, 2>(qkv, s, out, lse, scale, stream);
  }
}

/// The tensor-core dK/dV and dQ kernels with `tiling` (as forward_tiled).
void backward_tiled(const Tensor& dout, const Tensor& qkv, const Tensor& lse, const Tensor& delta,
                    const AttentionShape& s, const Tensor& dqkv, AttentionTiling tiling,
                    float scale, cudaStream_t stream) {
  if (s.head_dim == 128) {
    backward_tensor_cores<128, 1, 1>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  } else if (tiling == AttentionTiling::kRows16) {
    backward_tensor_cores<64, 1, 1>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  } else if (tiling == AttentionTiling::kRows32) {
    backward_tensor_cores<64, 1, 2>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  } else {
    backward_tensor_cores<64, 2, 2>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  }
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

/// Checks that the tensor-core path with `tiling` applies (attention_*_tiled's contract).
void check_tiled(const AttentionShape& s, DType dtype, std::initializer_list<const Tensor*> tensors,
                 AttentionTiling tiling, const char* op) {
  OCTET_CHECK(use_tensor_cores(s, dtype, tensors), op,
              ": the tensor-core path needs bf16, head_dim 64 or 128 and 16-byte aligned tensors; "
              "got ",
              dtype_name(dtype), " and head_dim ", s.head_dim);
  OCTET_CHECK(tiling == AttentionTiling::kRows16 || s.head_dim == 64, op, ": tiling ",
              attention_tiling_name(tiling), " supports head_dim 64 only, got ", s.head_dim);
}

/// delta = rowsum(dout * out) per (b, h, t), on the stream: the first kernel of every backward.
Tensor row_delta(const Tensor& dout, const Tensor& out, const AttentionShape& s,
                 cudaStream_t stream) {
  // Freed stream-ordered after the kernels that read it.
  Tensor delta = Tensor::empty({s.batch, s.heads, s.seq}, DType::f32, out.device());
  // head_dim / 8 lanes per (token, head): a power of two, so a group never straddles a warp.
  const int64_t lanes = s.head_dim / 8;
  const bool packed = s.head_dim % 8 == 0 && lanes <= kWarpSize && (lanes & (lanes - 1)) == 0 &&
                      reinterpret_cast<uintptr_t>(dout.raw_data()) % kFastAlignment == 0 &&
                      reinterpret_cast<uintptr_t>(out.raw_data()) % kFastAlignment == 0;
  if (out.dtype() == DType::bf16 && packed) {
    const int64_t rows = s.batch * s.seq * s.heads;
    attention_delta_bf16_kernel<<<grid_for(rows * lanes, kElementwiseThreads), kElementwiseThreads,
                                  0, stream>>>(static_cast<const uint16_t*>(dout.raw_data()),
                                               static_cast<const uint16_t*>(out.raw_data()),
                                               delta.data<float>(), rows, static_cast<int>(s.seq),
                                               static_cast<int>(s.heads), static_cast<int>(lanes));
    OCTET_CHECK_LAUNCH();
  } else if (out.dtype() == DType::bf16) {
    compute_delta<uint16_t>(dout, out, delta, s, stream);
  } else {
    compute_delta<float>(dout, out, delta, s, stream);
  }
  return delta;
}

}  // namespace

AttentionTiling default_attention_tiling(int64_t head_dim) {
  // Two row blocks per warp halve the shared-memory traffic per MMA (FastTiles); at head_dim
  // 128 their accumulators do not fit in registers.
  return head_dim == 64 ? AttentionTiling::kRows32 : AttentionTiling::kRows16;
}

const char* attention_tiling_name(AttentionTiling tiling) {
  switch (tiling) {
    case AttentionTiling::kRows16:
      return "rows16";
    case AttentionTiling::kRows32:
      return "rows32";
    case AttentionTiling::kRows32Dkdv:
      return "rows32_dkdv";
  }
  return "unknown";
}

void attention_forward_tiled(const Tensor& qkv, const AttentionShape& shape, const Tensor& out,
                             const Tensor& lse, AttentionTiling tiling) {
  check_tiled(shape, qkv.dtype(), {&qkv, &out}, tiling, "attention_forward_tiled");
  const Device device = qkv.device();
  DeviceGuard guard(device);
  forward_tiled(qkv, shape, out, lse, tiling, softmax_scale(shape), octet::cuda::stream(device));
}

void attention_backward_tiled(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, const AttentionShape& shape, const Tensor& dqkv,
                              AttentionTiling tiling) {
  check_tiled(shape, qkv.dtype(), {&qkv, &dout, &dqkv}, tiling, "attention_backward_tiled");
  const Device device = qkv.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const Tensor delta = row_delta(dout, out, shape, stream);
  backward_tiled(dout, qkv, lse, delta, shape, dqkv, tiling, softmax_scale(shape), stream);
}

void attention_forward(const Tensor& qkv, const AttentionShape& shape, const Tensor& out,
                       const Tensor& lse) {
  check_cuda_shape(shape, "attention_forward");
  const Device device = qkv.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const float scale = softmax_scale(shape);
  if (use_tensor_cores(shape, qkv.dtype(), {&qkv, &out})) {
    forward_tiled(qkv, shape, out, lse, default_attention_tiling(shape.head_dim), scale, stream);
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
  const Tensor delta = row_delta(dout, out, shape, stream);
  if (use_tensor_cores(shape, qkv.dtype(), {&qkv, &dout, &dqkv})) {
    backward_tiled(dout, qkv, lse, delta, shape, dqkv, default_attention_tiling(shape.head_dim),
                   scale, stream);
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
