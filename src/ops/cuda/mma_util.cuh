// Warp-level pieces of the bf16 tensor-core kernels (attention_flash.cuh) and of the tile
// quantizer (quantize_tile.cuh): the PTX of mma.sync.m16n8k16, ldmatrix and cp.async, and the
// m16n8k16 fragment products over bf16 tiles in shared memory stored as rows padded by kPad. CUDA
// sources only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "octet/fp8/format.h"
#include "ops/cuda/launch_util.cuh"

namespace octet::ops::cuda {

// mma.sync.m16n8k16 multiplies a 16x16 A by a 16x8 B (PTX ISA, "Warp-level matrix
// multiply-accumulate instructions", shape .m16n8k16 for .bf16).
inline constexpr int kMmaM = 16;
inline constexpr int kMmaN = 8;
inline constexpr int kMmaK = 16;
/// Shared-memory rows are padded by 8 bf16 (16 bytes): rows stay 16-byte aligned for cp.async and
/// ldmatrix, and consecutive rows start 4 banks apart (row stride = 4 mod 32 words for head_dim 64
/// and 128), so the 8 rows x 16 bytes of each ldmatrix phase hit 32 distinct banks.
inline constexpr int kPad = 8;

// ----------------------------------------------------------------------------
// Asynchronous global -> shared copies (sm_80+): whole tiles in flight without staging registers.

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}

/// Waits for this thread's cp.async copies (a __syncthreads() must follow for other threads').
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
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

// ----------------------------------------------------------------------------
// mma.sync and ldmatrix

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

// ----------------------------------------------------------------------------
// m16n8k16 fragments and the products of whole tiles

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

}  // namespace octet::ops::cuda
