// The tile quantizer shared by the CUDA quantize op and the ops that fuse an FP8 cast into the
// pass that produces their output (activations): a CTA stages a 128x128 tile of the matrix in
// shared memory, then writes the row-wise copy from tile rows and the column-wise copy from tile
// columns, each with 16-byte coalesced stores, plus block scales, the amax and column sums. 128 is
// the 1x128/128x128 block size, so every block of either copy (and every 32-element MXFP8 block)
// lies inside one tile and its amax is a shuffle reduction, with no second pass.
//
// What fills the tile is the Source: LoadTile copies a matrix (ops::quantize); an activation's
// source computes its output there (activation.cu). A Source is a copyable struct with
//   __device__ void stage(const TileParams& p, T* tile, int64_t r0, int64_t c0) const;
// that writes tile rows/columns [r0, r0 + 128) x [c0, c0 + 128) of the matrix, as T, at
// TileLayout<T>::chunk_offset, 0 outside the matrix, and ends with __syncthreads().
// CUDA sources only.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "octet/core/cuda_context.h"
#include "octet/core/device.h"
#include "octet/fp8/quantized_tensor.h"
#include "octet/ops/quantize.h"
#include "octet/ops/reduce.h"
#include "ops/activation_math.h"
#include "ops/cuda/fp8_kernels.cuh"
#include "ops/cuda/launch_util.cuh"
#include "ops/cuda/mma_util.cuh"
#include "ops/quantize_backend.h"
#include "ops/reduce_backend.h"
#include "ops/sorted_search.h"

namespace octet::ops::cuda::quant {

using fp8::ScalingMode;

/// Largest finite value of the FP8 dtype kFp8, at compile time.
template <DType kFp8>
inline constexpr float kFp8Max = fp8::fp8_max(kFp8);

// ----------------------------------------------------------------------------
// Tile geometry of the quantize kernel

/// Side of the square tile one CTA quantizes: the 1x128 / 128x128 block size.
inline constexpr int kTile = static_cast<int>(fp8::kBlock);
/// MXFP8 block length.
inline constexpr int kMx = static_cast<int>(fp8::kMxBlock);
inline constexpr int kTileThreads = 256;
inline constexpr int kTileWarps = kTileThreads / kWarpSize;

// Row pass: a thread quantizes 16-element runs of tile rows; 8 consecutive lanes cover one row.
inline constexpr int kRunsPerRow = kTile / kRunElems;
inline constexpr int kRowsPerRowPass = kTileThreads / kRunsPerRow;
inline constexpr int kRowPasses = kTile / kRowsPerRowPass;
/// Lanes sharing one MXFP8 block in either pass.
inline constexpr int kRunsPerMx = kMx / kRunElems;

// Column pass: a thread quantizes two adjacent columns over 16 rows (two 16-byte runs of data_t);
// lane = run * 4 + pair, so the 8 lanes holding one column's 128 rows differ in lane bits 2..4,
// and a warp writes 8 data_t rows of 128 contiguous bytes.
inline constexpr int kColRunsPerCol = kTile / kRunElems;
inline constexpr int kColPairsPerWarp = kWarpSize / kColRunsPerCol;
inline constexpr int kColsPerWarp = 2 * kColPairsPerWarp;
inline constexpr int kColPasses = kTile / (kColsPerWarp * kTileWarps);

static_assert(kTile % kMx == 0 && kMx % kRunElems == 0, "MXFP8 blocks must tile the 128 tile");
static_assert(kWarpSize % kRunsPerRow == 0, "a tile row's lanes must lie in one warp");
static_assert(kTile % kRowsPerRowPass == 0, "row passes must cover the tile");
static_assert((kColRunsPerCol & (kColRunsPerCol - 1)) == 0 && kColPairsPerWarp >= 1 &&
                  (kColPairsPerWarp & (kColPairsPerWarp - 1)) == 0,
              "column lanes must be selectable by a lane-bit mask");
static_assert(kTile % (kColsPerWarp * kTileWarps) == 0, "column passes must cover the tile");

/// 16-byte chunks in one 128-byte sweep of the 32 shared-memory banks.
inline constexpr int kBankChunks = 8;

/// Shared-memory layout of a 128x128 tile of T (f32, or bf16 bits): rows of 16-byte chunks with
/// no padding (cp.async and LDS.128 stay aligned), and two XOR swizzles, each a bijection within
/// a row, that make every access pattern bank-conflict-free:
/// - chunk j ^= (j / 8) % chunks_per_run: the 8 lanes (one row) of a row-pass quarter-warp read
///   chunks run*chunks_per_run + k, which would otherwise repeat banks across the row's halves;
/// - chunk ^= (r / 16 % 8) * column_swizzle: a warp of the column pass reads the same 8 columns
///   (bf16: one chunk, f32: two) from 8 rows 16 apart, which would otherwise share banks.
/// Both claims were checked by enumerating every access of both passes: the mapping is a
/// bijection per row, and each LDS wavefront touches 32 distinct banks.
template <typename T>
struct TileLayout {
  static inline constexpr int kChunkElems = kVecElems<T>;
  static inline constexpr int kChunksPerRow = kTile / kChunkElems;
  static inline constexpr int kChunksPerRun = kRunElems / kChunkElems;
  /// Chunks of one row that a warp's column-pass access covers (8 columns).
  static inline constexpr int kColSwizzle = kColsPerWarp * static_cast<int>(sizeof(T)) / kVecBytes;
  static inline constexpr int kBytes = kTile * kTile * static_cast<int>(sizeof(T));
  static_assert(kChunksPerRow % (2 * kBankChunks) == 0 && kChunksPerRun <= kBankChunks &&
                    (kBankChunks - 1) * kColSwizzle < 2 * kBankChunks,
                "the swizzles XOR values below 16 into rows of a multiple of 16 chunks");

  /// Offset in elements of chunk j of tile row r. Depends on r only through r / kRunElems, so
  /// the 16 rows of one column run share it up to r * kTile.
  __device__ static int chunk_offset(int r, int j) {
    const int phys = j ^ ((j / kBankChunks) & (kChunksPerRun - 1)) ^
                     (((r / kRunElems) % kBankChunks) * kColSwizzle);
    return r * kTile + phys * kChunkElems;
  }
};

/// Everything a tile kernel needs; scale tensors are laid out as QuantizedTensor documents.
struct TileParams {
  int64_t rows, cols;
  int64_t tile_rows, tile_cols;  ///< tiles along each dimension = the 128-block grid
  int64_t mx_rows, mx_cols;      ///< ceil(rows / 32), ceil(cols / 32)
  uint8_t* data;                 ///< [rows, cols], or nullptr without a row-wise copy
  void* scale_inv;               ///< scales of data (f32, e8m0 for mxfp8), or nullptr
  uint8_t* data_t;               ///< [cols, rows], or nullptr without a column-wise copy
  void* scale_inv_t;             ///< scales of data_t; per_tensor: nullptr when it is scale_inv
  const float* scale;            ///< per_tensor: the multiplier, f32[1]
  uint32_t* amax;                ///< optional: raised to max|x| after every FP8 store
  bool data_vec, data_t_vec;     ///< 16-byte vector stores allowed (alignment, extents)
  bool power_of_2;               ///< block modes: power-of-two scales
  /// Optional, with data_t: [tile_rows, cols], each tile's column sums in sum_rows' order
  /// (combine_row_partials finishes them).
  float* col_partials;
};

// ----------------------------------------------------------------------------
// Device pieces of the tile kernel

/// Copies the tile at (r0, c0) of x into shared memory; cells outside x become 0, which no amax
/// notices and no store writes back. Full, aligned chunks go by cp.async (8 or 16 per thread in
/// flight), the rest element by element.
template <typename T>
__device__ __forceinline__ void load_tile(const TileParams& p, const T* x, bool x_vec, T* tile,
                                          int64_t r0, int64_t c0) {
  using L = TileLayout<T>;
  static_assert(kTile * L::kChunksPerRow % kTileThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kTile * L::kChunksPerRow / kTileThreads; ++i) {
    const int idx = static_cast<int>(threadIdx.x) + i * kTileThreads;
    const int r = idx / L::kChunksPerRow, j = idx % L::kChunksPerRow;
    const int64_t gr = r0 + r, gc = c0 + static_cast<int64_t>(j) * L::kChunkElems;
    T* dst = tile + L::chunk_offset(r, j);
    if (x_vec && gr < p.rows && gc + L::kChunkElems <= p.cols) {
      cp_async_16(dst, x + gr * p.cols + gc);
    } else {
#pragma unroll
      for (int e = 0; e < L::kChunkElems; ++e)
        dst[e] = (gr < p.rows && gc + e < p.cols) ? x[gr * p.cols + gc + e] : T(0);
    }
  }
  cp_async_wait_all();
  __syncthreads();
}

/// Two bf16 maxima in one word: m's halves raised to the abs bits of w's halves. Over bf16 words
/// this takes one masking and a third of a three-way packed max (VIMNMX3.U16x2) per two elements,
/// where abs_bits on the unpacked floats takes a masking and half a max per element; the maxima
/// are the same, since a bf16's float bits are its bits shifted up by 16.
__device__ __forceinline__ uint32_t bf16x2_abs_max(uint32_t m, uint32_t w) {
  return __vmaxu2(m, w & 0x7FFF7FFFu);
}

/// The 16-element run `run` of tile row r, as floats; returns its max abs_bits (unused results
/// cost nothing: the compiler drops them).
template <typename T>
__device__ __forceinline__ uint32_t read_row_run(const T* tile, int r, int run, float* v) {
  using L = TileLayout<T>;
  uint32_t packed = 0;  // bf16: the run's two half-word maxima
#pragma unroll
  for (int k = 0; k < L::kChunksPerRun; ++k) {
    const uint4 u =
        *reinterpret_cast<const uint4*>(tile + L::chunk_offset(r, run * L::kChunksPerRun + k));
    unpack<T>(u, v + k * L::kChunkElems);
    if constexpr (sizeof(T) == sizeof(uint16_t)) {
      packed = bf16x2_abs_max(bf16x2_abs_max(packed, u.x), u.y);
      packed = bf16x2_abs_max(bf16x2_abs_max(packed, u.z), u.w);
    }
  }
  if constexpr (sizeof(T) == sizeof(float)) {
    return run_amax_bits(v);
  } else {
    return max(packed << 16, packed & 0xFFFF0000u);
  }
}

/// Columns c and c + 1 (c even) of tile rows [r_begin, r_begin + 16), r_begin a multiple of 16;
/// amax_a and amax_b get each column's max abs_bits (dropped by the compiler when unused).
template <typename T>
__device__ __forceinline__ void read_column_pair(const T* tile, int r_begin, int c, float* a,
                                                 float* b, uint32_t& amax_a, uint32_t& amax_b) {
  using L = TileLayout<T>;
  // One swizzle for the whole run (chunk_offset depends on r / 16 only): row k is k * kTile on.
  const T* pair = tile + L::chunk_offset(r_begin, c / L::kChunkElems) + c % L::kChunkElems;
  uint32_t packed = 0;  // bf16: column c's maximum in the low half, c + 1's in the high half
#pragma unroll
  for (int k = 0; k < kRunElems; ++k) {
    if constexpr (sizeof(T) == sizeof(float)) {
      const float2 f = *reinterpret_cast<const float2*>(pair + k * kTile);
      a[k] = f.x;
      b[k] = f.y;
    } else {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(pair + k * kTile);
      a[k] = __uint_as_float(w << 16);
      b[k] = __uint_as_float(w & 0xFFFF0000u);
      packed = bf16x2_abs_max(packed, w);
    }
  }
  if constexpr (sizeof(T) == sizeof(float)) {
    amax_a = run_amax_bits(a);
    amax_b = run_amax_bits(b);
  } else {
    amax_a = packed << 16;
    amax_b = packed & 0xFFFF0000u;
  }
}

/// Writes the row-wise copy of the tile (ti, tj) and its block scales. want_amax: per_tensor only,
/// whether to fold |x| into amax_bits (block modes always do, 128x128 did it already).
template <typename T, ScalingMode kMode, DType kFp8>
__device__ __forceinline__ void quantize_tile_rows(const TileParams& p, const T* tile, int64_t ti,
                                                   int64_t tj, float tile_multiplier,
                                                   bool want_amax, uint32_t& amax_bits) {
  const int run = static_cast<int>(threadIdx.x) % kRunsPerRow;
  const int64_t gc = tj * kTile + run * kRunElems;
#pragma unroll
  for (int i = 0; i < kRowPasses; ++i) {
    const int r = static_cast<int>(threadIdx.x) / kRunsPerRow + i * kRowsPerRowPass;
    const int64_t gr = ti * kTile + r;
    float v[kRunElems];
    const uint32_t m = read_row_run<T>(tile, r, run, v);
    float multiplier = tile_multiplier;
    if constexpr (kMode == ScalingMode::block_1x128) {
      amax_bits = max(amax_bits, m);
      const uint32_t block = lane_group_max<kRunsPerRow - 1>(m);  // the 8 lanes of row r
      multiplier = fp8::block_scale(fp8::bits_float(block), kFp8Max<kFp8>, p.power_of_2);
      if (run == 0 && gr < p.rows)
        static_cast<float*>(p.scale_inv)[gr * p.tile_cols + tj] = fp8::scale_inv_of(multiplier);
    } else if constexpr (kMode == ScalingMode::mxfp8_1x32) {
      amax_bits = max(amax_bits, m);
      const uint32_t block = lane_group_max<kRunsPerMx - 1>(m);  // the 2 lanes of a 32-block
      const uint8_t e = fp8::mxfp8_scale_inv(fp8::bits_float(block), kFp8Max<kFp8>);
      multiplier = fp8::mxfp8_multiplier(e);
      if (run % kRunsPerMx == 0 && gr < p.rows && gc < p.cols)
        static_cast<uint8_t*>(p.scale_inv)[gr * p.mx_cols + gc / kMx] = e;
    } else if constexpr (kMode == ScalingMode::per_tensor) {
      if (want_amax) amax_bits = max(amax_bits, m);
    }
    const uint4 q = quantize_run<kFp8>(v, multiplier);
    if (gr < p.rows) store_fp8_run(p.data + gr * p.cols + gc, p.cols - gc, p.data_vec, q);
  }
}

/// The tile's partial column sums for columns gc and gc + 1, from the lanes' 16-row runs a and b
/// (rows 16 col_run ... of the tile; rows past x are 0 and change no sum): each run summed
/// sequentially, then the tile's 8 runs in order, which is sum_rows' order (reduce.h). Every lane
/// of the warp must call it.
__device__ __forceinline__ void add_column_partials(const TileParams& p, int64_t ti, int64_t gc,
                                                    int pair, int col_run, const float* a,
                                                    const float* b) {
  static_assert(kRunElems == kSumRowsRunRows && kTile == kSumRowsTileRows,
                "a lane's column run is one of sum_rows' runs, a tile one of its tiles");
  float run_a = 0.0f, run_b = 0.0f;
#pragma unroll
  for (int k = 0; k < kRunElems; ++k) {
    run_a += a[k];
    run_b += b[k];
  }
  // The runs of these columns sit in lanes pair, pair + kColPairsPerWarp, ... in row order.
  float tile_a = __shfl_sync(kFullMask, run_a, pair);
  float tile_b = __shfl_sync(kFullMask, run_b, pair);
#pragma unroll
  for (int run = 1; run < kColRunsPerCol; ++run) {
    tile_a += __shfl_sync(kFullMask, run_a, pair + run * kColPairsPerWarp);
    tile_b += __shfl_sync(kFullMask, run_b, pair + run * kColPairsPerWarp);
  }
  if (col_run != 0) return;
  if (gc < p.cols) p.col_partials[ti * p.cols + gc] = tile_a;
  if (gc + 1 < p.cols) p.col_partials[ti * p.cols + gc + 1] = tile_b;
}

/// Writes the column-wise copy (data_t rows = tile columns) of the tile (ti, tj) and its scales.
template <typename T, ScalingMode kMode, DType kFp8>
__device__ __forceinline__ void quantize_tile_cols(const TileParams& p, const T* tile, int64_t ti,
                                                   int64_t tj, float tile_multiplier,
                                                   bool want_amax, uint32_t& amax_bits) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int pair = lane % kColPairsPerWarp;
  const int col_run = lane / kColPairsPerWarp;  // rows [16 col_run, 16 col_run + 16) of the tile
  const int r = col_run * kRunElems;
  const int64_t gr = ti * kTile + r;
#pragma unroll
  for (int i = 0; i < kColPasses; ++i) {
    const int c = (warp + i * kTileWarps) * kColsPerWarp + 2 * pair;
    const int64_t gc = tj * kTile + c;  // columns gc and gc + 1 of x
    float a[kRunElems], b[kRunElems];
    uint32_t ma, mb;  // the two columns' max abs_bits
    read_column_pair<T>(tile, r, c, a, b, ma, mb);
    float mul_a = tile_multiplier, mul_b = tile_multiplier;
    if constexpr (kMode == ScalingMode::block_1x128) {
      amax_bits = max(amax_bits, max(ma, mb));
      constexpr unsigned kColumnLanes = (kColRunsPerCol - 1) * kColPairsPerWarp;
      mul_a = fp8::block_scale(fp8::bits_float(lane_group_max<kColumnLanes>(ma)), kFp8Max<kFp8>,
                               p.power_of_2);
      mul_b = fp8::block_scale(fp8::bits_float(lane_group_max<kColumnLanes>(mb)), kFp8Max<kFp8>,
                               p.power_of_2);
      if (col_run == 0) {
        float* s = static_cast<float*>(p.scale_inv_t);  // [cols, tile_rows]
        if (gc < p.cols) s[gc * p.tile_rows + ti] = fp8::scale_inv_of(mul_a);
        if (gc + 1 < p.cols) s[(gc + 1) * p.tile_rows + ti] = fp8::scale_inv_of(mul_b);
      }
    } else if constexpr (kMode == ScalingMode::mxfp8_1x32) {
      amax_bits = max(amax_bits, max(ma, mb));
      constexpr unsigned kBlockLanes = (kRunsPerMx - 1) * kColPairsPerWarp;
      const uint8_t ea =
          fp8::mxfp8_scale_inv(fp8::bits_float(lane_group_max<kBlockLanes>(ma)), kFp8Max<kFp8>);
      const uint8_t eb =
          fp8::mxfp8_scale_inv(fp8::bits_float(lane_group_max<kBlockLanes>(mb)), kFp8Max<kFp8>);
      mul_a = fp8::mxfp8_multiplier(ea);
      mul_b = fp8::mxfp8_multiplier(eb);
      if (col_run % kRunsPerMx == 0 && gr < p.rows) {
        uint8_t* s = static_cast<uint8_t*>(p.scale_inv_t);  // [cols, mx_rows]
        if (gc < p.cols) s[gc * p.mx_rows + gr / kMx] = ea;
        if (gc + 1 < p.cols) s[(gc + 1) * p.mx_rows + gr / kMx] = eb;
      }
    } else if constexpr (kMode == ScalingMode::per_tensor) {
      if (want_amax) amax_bits = max(amax_bits, max(ma, mb));
    }
    if (p.col_partials != nullptr) add_column_partials(p, ti, gc, pair, col_run, a, b);
    const uint4 qa = quantize_run<kFp8>(a, mul_a);
    const uint4 qb = quantize_run<kFp8>(b, mul_b);
    if (gc < p.cols) store_fp8_run(p.data_t + gc * p.rows + gr, p.rows - gr, p.data_t_vec, qa);
    if (gc + 1 < p.cols)
      store_fp8_run(p.data_t + (gc + 1) * p.rows + gr, p.rows - gr, p.data_t_vec, qb);
  }
}

/// The tile is x itself, copied by cp.async: ops::quantize.
template <typename T>
struct LoadTile {
  const T* x;
  bool x_vec;  ///< x aligned and cols a multiple of a 16-byte vector
  __device__ void stage(const TileParams& p, T* tile, int64_t r0, int64_t c0) const {
    load_tile<T>(p, x, x_vec, tile, r0, c0);
  }
};

// ----------------------------------------------------------------------------
// The kernel

/// Quantizes the 128x128 tile `index` (row-major over the tile grid) of x, as Source stages it,
/// into the row-wise and/or column-wise copy in scaling mode kMode, with their scales and optional
/// amax: the body of the tile kernels, run by all kTileThreads threads of a CTA. `tile` is
/// TileLayout<T>::kBytes of shared memory, `scratch` kTileWarps words.
template <typename T, ScalingMode kMode, DType kFp8, typename Source>
__device__ __forceinline__ void quantize_tile(const TileParams& p, const Source& source,
                                              int64_t index, T* tile, uint32_t* scratch) {
  const int64_t ti = index / p.tile_cols, tj = index % p.tile_cols;
  source.stage(p, tile, ti * kTile, tj * kTile);

  uint32_t amax_bits = 0;   // this thread's max abs_bits(x), for p.amax
  float multiplier = 1.0f;  // per_tensor and block_128x128: the tile's one multiplier
  if constexpr (kMode == ScalingMode::per_tensor) {
    multiplier = *p.scale;
    if (index == 0 && threadIdx.x == 0) {
      if (p.scale_inv != nullptr)
        static_cast<float*>(p.scale_inv)[0] = fp8::scale_inv_of(multiplier);
      if (p.scale_inv_t != nullptr)
        static_cast<float*>(p.scale_inv_t)[0] = fp8::scale_inv_of(multiplier);
    }
  } else if constexpr (kMode == ScalingMode::block_128x128) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kRowPasses; ++i) {
      float v[kRunElems];
      m = max(m, read_row_run<T>(tile,
                                 static_cast<int>(threadIdx.x) / kRunsPerRow + i * kRowsPerRowPass,
                                 static_cast<int>(threadIdx.x) % kRunsPerRow, v));
    }
    amax_bits = block_max<kTileThreads>(m, scratch);  // the tile's amax, in every thread
    multiplier = fp8::block_scale(fp8::bits_float(amax_bits), kFp8Max<kFp8>, p.power_of_2);
    if (threadIdx.x == 0) {
      const float scale_inv = fp8::scale_inv_of(multiplier);
      if (p.scale_inv != nullptr)  // [tile_rows, tile_cols]
        static_cast<float*>(p.scale_inv)[ti * p.tile_cols + tj] = scale_inv;
      if (p.scale_inv_t != nullptr)  // the transposed grid [tile_cols, tile_rows]
        static_cast<float*>(p.scale_inv_t)[tj * p.tile_rows + ti] = scale_inv;
    }
  }
  const bool want_amax = p.amax != nullptr;
  if (p.data != nullptr)
    quantize_tile_rows<T, kMode, kFp8>(p, tile, ti, tj, multiplier, want_amax, amax_bits);
  if (p.data_t != nullptr) {
    quantize_tile_cols<T, kMode, kFp8>(p, tile, ti, tj, multiplier, want_amax && p.data == nullptr,
                                       amax_bits);
  }
  if (p.amax != nullptr) publish_amax<kTileThreads>(amax_bits, p.amax, scratch);
}

/// One CTA per tile of the matrix (blockIdx.x = tile). Traffic per bf16 element: 2 B read, 1 B per
/// copy written (4 B with both copies; 6 B for f32), all as 16-byte coalesced accesses; shared
/// memory is bank-conflict-free (TileLayout). Expect >= 85% of copy bandwidth for per-tensor
/// cast-transpose and >= 75% for the block modes at large aligned shapes; edge tiles and unaligned
/// shapes take the element-wise fallbacks.
template <typename T, ScalingMode kMode, DType kFp8, typename Source>
__global__ void __launch_bounds__(kTileThreads)
    quantize_tile_kernel(const TileParams p, const Source source) {
  extern __shared__ uint4 tile_smem[];  // TileLayout<T>::kBytes
  __shared__ uint32_t scratch[kTileWarps];
  quantize_tile<T, kMode, kFp8>(p, source, blockIdx.x, reinterpret_cast<T*>(tile_smem), scratch);
}

/// Matrices per launch of the group kernel: a TileGroup of 16 with an MoE expert's source is
/// about 3 KB, inside the 4 KB of kernel parameters that every CUDA version accepts.
inline constexpr int kMaxTileGroup = 16;
inline constexpr size_t kPortableParamBytes = 4096;

/// Up to kMaxTileGroup matrices quantized by one launch: matrix m owns the CTAs [first_tile[m],
/// first_tile[m + 1]), one per tile, so many small matrices fill the device together.
template <typename Source>
struct TileGroup {
  TileParams params[kMaxTileGroup];
  Source sources[kMaxTileGroup];
  int64_t first_tile[kMaxTileGroup + 1];
  int count;
};

/// CTAs per SM that the group kernel's registers must allow (64 a thread). Unbounded, bf16
/// sources take 80-115: a matrix's parameters are indexed loads there, not the constant operands
/// of the one-matrix kernel, which would leave 2 CTAs per SM.
inline constexpr int kTileGroupCtasPerSm = 4;

template <typename T, ScalingMode kMode, DType kFp8, typename Source>
__global__ void __launch_bounds__(kTileThreads, kTileGroupCtasPerSm)
    quantize_tile_group_kernel(const __grid_constant__ TileGroup<Source> group) {
  extern __shared__ uint4 tile_smem[];  // TileLayout<T>::kBytes
  __shared__ uint32_t scratch[kTileWarps];
  // This CTA's matrix: the last m with first_tile[m] <= blockIdx.x (uniform over the CTA).
  const int64_t m = last_start_at_most(group.first_tile, group.count, int64_t{blockIdx.x});
  quantize_tile<T, kMode, kFp8>(group.params[m], group.sources[m], blockIdx.x - group.first_tile[m],
                                reinterpret_cast<T*>(tile_smem), scratch);
}

// ----------------------------------------------------------------------------
// Host side

/// Calls f with the scaling mode as a compile-time constant.
template <typename F>
void visit_mode(ScalingMode mode, F&& f) {
  switch (mode) {
    case ScalingMode::per_tensor:
      return f(std::integral_constant<ScalingMode, ScalingMode::per_tensor>{});
    case ScalingMode::block_1x128:
      return f(std::integral_constant<ScalingMode, ScalingMode::block_1x128>{});
    case ScalingMode::block_128x128:
      return f(std::integral_constant<ScalingMode, ScalingMode::block_128x128>{});
    case ScalingMode::mxfp8_1x32:
      return f(std::integral_constant<ScalingMode, ScalingMode::mxfp8_1x32>{});
  }
  OCTET_ERROR("quantize: unknown scaling mode ", static_cast<int>(mode));
}

/// The tensor's data, or nullptr when it is undefined.
template <typename T>
T* data_or_null(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.raw_data()) : nullptr;
}

/// Launches `kernel` (a tile kernel for T) with one CTA per tile and the tile in dynamic shared
/// memory; f32 tiles (64 KiB) need the opt-in, once per device, recorded in the kernel's own
/// `opted_in`.
template <typename T, typename Kernel, typename... Args>
void launch_tile_kernel(Kernel kernel, octet::cuda::PerDeviceFlag& opted_in, int64_t tiles,
                        const Device& device, cudaStream_t stream, const Args&... args) {
  constexpr size_t kSmemBytes = TileLayout<T>::kBytes;
  if constexpr (kSmemBytes > kDefaultDynamicSmemBytes)
    opt_in_shared_memory(kernel, kSmemBytes, device, opted_in);
  kernel<<<static_cast<unsigned>(tiles), kTileThreads, kSmemBytes, stream>>>(args...);
  OCTET_CHECK_LAUNCH();
}

template <typename T, ScalingMode kMode, DType kFp8, typename Source>
void launch_quantize_tile(const TileParams& p, const Source& source, const Device& device,
                          cudaStream_t stream) {
  static octet::cuda::PerDeviceFlag opted_in;
  const int64_t tiles = p.tile_rows * p.tile_cols;
  OCTET_CHECK(tiles <= INT_MAX, "quantize: a [", p.rows, ", ", p.cols, "] matrix has ", tiles,
              " tiles of ", kTile, "x", kTile, "; expected at most ", INT_MAX, " (gridDim.x)");
  launch_tile_kernel<T>(quantize_tile_kernel<T, kMode, kFp8, Source>, opted_in, tiles, device,
                        stream, p, source);
}

template <typename T, ScalingMode kMode, DType kFp8, typename Source>
void launch_quantize_tile_group(const TileGroup<Source>& group, const Device& device,
                                cudaStream_t stream) {
  static_assert(
      sizeof(TileGroup<Source>) <= kPortableParamBytes,
      "a TileGroup of this Source exceeds 4 KB of kernel parameters: lower kMaxTileGroup");
  static octet::cuda::PerDeviceFlag opted_in;
  const int64_t tiles = group.first_tile[group.count];
  OCTET_CHECK(tiles <= INT_MAX, "quantize: a group of ", group.count, " matrices has ", tiles,
              " tiles of ", kTile, "x", kTile, "; expected at most ", INT_MAX, " (gridDim.x)");
  launch_tile_kernel<T>(quantize_tile_group_kernel<T, kMode, kFp8, Source>, opted_in, tiles, device,
                        stream, group);
}

/// TileParams for quantizing a [rows, cols] matrix into `out` with `args`, without column sums.
inline TileParams tile_params(int64_t rows, int64_t cols, fp8::QuantizedTensor& out,
                              const QuantizeArgs& args) {
  TileParams p{};
  p.rows = rows;
  p.cols = cols;
  p.tile_rows = ceil_div(rows, kTile);
  p.tile_cols = ceil_div(cols, kTile);
  p.mx_rows = ceil_div(rows, kMx);
  p.mx_cols = ceil_div(cols, kMx);
  p.data = data_or_null<uint8_t>(out.data);
  p.scale_inv = p.data != nullptr ? out.scale_inv.raw_data() : nullptr;
  p.data_t = data_or_null<uint8_t>(out.data_t);
  p.scale_inv_t = p.data_t != nullptr ? out.scale_inv_t.raw_data() : nullptr;
  // per_tensor with both copies usually shares one scale_inv tensor: write it once.
  if (out.mode == ScalingMode::per_tensor && p.scale_inv_t == p.scale_inv) p.scale_inv_t = nullptr;
  p.scale = data_or_null<const float>(args.scale);
  p.amax = data_or_null<uint32_t>(args.amax);
  p.data_vec = p.data != nullptr && vec_aligned(p.data) && cols % kRunElems == 0;
  p.data_t_vec = p.data_t != nullptr && vec_aligned(p.data_t) && rows % kRunElems == 0;
  p.power_of_2 = args.power_of_2_block_scales;
  return p;
}

/// Quantizes the [rows, cols] matrix that `source` stages (of element type T) into `out` with the
/// tile kernel: whichever copies `out` has allocated, their scales, args.amax, and args.column_sums
/// when the transposed copy is written (the column pass computes them). Returns whether the
/// column sums were done; if not, the caller adds them (sum_rows over the matrix).
template <typename T, typename Source>
bool quantize_tiles(int64_t rows, int64_t cols, fp8::QuantizedTensor& out, const QuantizeArgs& args,
                    const Source& source, const Device& device) {
  TileParams p = tile_params(rows, cols, out, args);
  // Column sums ride on the column pass.
  Tensor col_partials;  // stream-ordered workspace, freed after the kernels that use it
  if (args.column_sums.defined() && p.data_t != nullptr) {
    col_partials = Tensor::empty({p.tile_rows, cols}, DType::f32, device);
    p.col_partials = col_partials.data<float>();
  }
  const cudaStream_t stream = octet::cuda::stream(device);
  visit_mode(out.mode, [&](auto mode_tag) {
    visit_fp8(out.dtype, [&](auto fp8_tag) {
      launch_quantize_tile<T, decltype(mode_tag)::value, decltype(fp8_tag)::value>(p, source,
                                                                                   device, stream);
    });
  });
  if (!col_partials.defined()) return false;
  combine_row_partials(col_partials, args.column_sums, args.accumulate_column_sums);
  return true;
}

/// One matrix of quantize_tile_group: [rows, cols] (both > 0) as `source` stages it, quantized into
/// *out with *args (column sums only with a transposed copy, whose pass computes them).
template <typename Source>
struct TileMatrix {
  int64_t rows, cols;
  fp8::QuantizedTensor* out;
  const QuantizeArgs* args;
  Source source;
};

/// quantize_tiles for many matrices of element type T: each run of consecutive matrices with one
/// scaling mode and FP8 dtype goes in launches of up to kMaxTileGroup, so small matrices (an MoE's
/// experts) share the device instead of taking a launch each. The results are those of
/// quantize_tiles on each matrix: the same tile body with the same parameters, and column sums
/// finished by the same second pass.
template <typename T, typename Source>
void quantize_tile_group(std::span<const TileMatrix<Source>> matrices, const Device& device) {
  const cudaStream_t stream = octet::cuda::stream(device);
  std::vector<Tensor> col_partials(matrices.size());  // stream-ordered workspaces
  for (size_t begin = 0; begin < matrices.size();) {
    const fp8::QuantizedTensor& first = *matrices[begin].out;
    TileGroup<Source> group{};
    size_t end = begin;
    for (; end < matrices.size() && group.count < kMaxTileGroup; ++end) {
      const TileMatrix<Source>& m = matrices[end];
      if (m.out->mode != first.mode || m.out->dtype != first.dtype) break;
      const bool sums = m.args->column_sums.defined();
      OCTET_CHECK(m.rows > 0 && m.cols > 0 && (!sums || m.out->has_columnwise()),
                  "quantize_tile_group: matrix ", end, " is [", m.rows, ", ", m.cols,
                  "] with column sums ", sums ? "on" : "off", " and ",
                  m.out->has_columnwise() ? "a" : "no",
                  " transposed copy; expected a non-empty matrix, and column sums only with the "
                  "transposed copy");
      TileParams p = tile_params(m.rows, m.cols, *m.out, *m.args);
      if (sums) {
        col_partials[end] = Tensor::empty({p.tile_rows, m.cols}, DType::f32, device);
        p.col_partials = col_partials[end].data<float>();
      }
      group.params[group.count] = p;
      group.sources[group.count] = m.source;
      group.first_tile[group.count + 1] = group.first_tile[group.count] + p.tile_rows * p.tile_cols;
      ++group.count;
    }
    visit_mode(first.mode, [&](auto mode_tag) {
      visit_fp8(first.dtype, [&](auto fp8_tag) {
        launch_quantize_tile_group<T, decltype(mode_tag)::value, decltype(fp8_tag)::value>(
            group, device, stream);
      });
    });
    begin = end;
  }
  for (size_t i = 0; i < matrices.size(); ++i) {
    if (!col_partials[i].defined()) continue;
    combine_row_partials(col_partials[i], matrices[i].args->column_sums,
                         matrices[i].args->accumulate_column_sums);
  }
}

}  // namespace octet::ops::cuda::quant
