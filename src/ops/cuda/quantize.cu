// CUDA backend of the quantize family: amax, quantize (per-tensor, 1x128, 128x128, MXFP8; with
// the fused transposed copy), dequantize, cast. Bit-exact with the CPU reference
// (src/ops/cpu/quantize.cc): the same scalar formulas (format.h, scaling_math.h), the same single
// float multiply per element, and maxima over amax bit patterns, which no reduction order changes.
//
// The quantize work horse is one tile kernel: a CTA stages a 128x128 tile of x in shared memory
// (cp.async, 16-byte chunks), then writes the row-wise copy from tile rows and the column-wise
// copy from tile columns, each with 16-byte coalesced stores. 128 is the 1x128/128x128 block size,
// so every block of either copy (and every 32-element MXFP8 block) lies inside one tile and its
// amax is a shuffle reduction, with no second pass.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "octet/core/cuda_context.h"
#include "octet/core/device.h"
#include "ops/cuda/fp8_kernels.cuh"
#include "ops/quantize_backend.h"
#include "ops/reduce_backend.h"

namespace octet::ops::cuda {
namespace quant {
namespace {

using fp8::ScalingMode;

/// Largest finite value of the FP8 dtype kFp8, at compile time.
template <DType kFp8>
inline constexpr float kFp8Max = fp8::fp8_max(kFp8);

// ----------------------------------------------------------------------------
// Tile geometry of the quantize kernel

/// Side of the square tile one CTA quantizes: the 1x128 / 128x128 block size.
constexpr int kTile = static_cast<int>(fp8::kBlock);
/// MXFP8 block length.
constexpr int kMx = static_cast<int>(fp8::kMxBlock);
constexpr int kTileThreads = 256;
constexpr int kTileWarps = kTileThreads / kWarpSize;

// Row pass: a thread quantizes 16-element runs of tile rows; 8 consecutive lanes cover one row.
constexpr int kRunsPerRow = kTile / kRunElems;
constexpr int kRowsPerRowPass = kTileThreads / kRunsPerRow;
constexpr int kRowPasses = kTile / kRowsPerRowPass;
/// Lanes sharing one MXFP8 block in either pass.
constexpr int kRunsPerMx = kMx / kRunElems;

// Column pass: a thread quantizes two adjacent columns over 16 rows (two 16-byte runs of data_t);
// lane = run * 4 + pair, so the 8 lanes holding one column's 128 rows differ in lane bits 2..4,
// and a warp writes 8 data_t rows of 128 contiguous bytes.
constexpr int kColRunsPerCol = kTile / kRunElems;
constexpr int kColPairsPerWarp = kWarpSize / kColRunsPerCol;
constexpr int kColsPerWarp = 2 * kColPairsPerWarp;
constexpr int kColPasses = kTile / (kColsPerWarp * kTileWarps);

static_assert(kTile % kMx == 0 && kMx % kRunElems == 0, "MXFP8 blocks must tile the 128 tile");
static_assert(kWarpSize % kRunsPerRow == 0, "a tile row's lanes must lie in one warp");
static_assert(kTile % kRowsPerRowPass == 0, "row passes must cover the tile");
static_assert((kColRunsPerCol & (kColRunsPerCol - 1)) == 0 && kColPairsPerWarp >= 1 &&
                  (kColPairsPerWarp & (kColPairsPerWarp - 1)) == 0,
              "column lanes must be selectable by a lane-bit mask");
static_assert(kTile % (kColsPerWarp * kTileWarps) == 0, "column passes must cover the tile");

/// 16-byte chunks in one 128-byte sweep of the 32 shared-memory banks.
constexpr int kBankChunks = 8;

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
  static constexpr int kChunkElems = kVecElems<T>;
  static constexpr int kChunksPerRow = kTile / kChunkElems;
  static constexpr int kChunksPerRun = kRunElems / kChunkElems;
  /// Chunks of one row that a warp's column-pass access covers (8 columns).
  static constexpr int kColSwizzle = kColsPerWarp * static_cast<int>(sizeof(T)) / kVecBytes;
  static constexpr int kBytes = kTile * kTile * static_cast<int>(sizeof(T));
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
  const void* x;
  int64_t rows, cols;
  int64_t tile_rows, tile_cols;      ///< tiles along each dimension = the 128-block grid
  int64_t mx_rows, mx_cols;          ///< ceil(rows / 32), ceil(cols / 32)
  uint8_t* data;                     ///< [rows, cols], or nullptr without a row-wise copy
  void* scale_inv;                   ///< scales of data (f32, e8m0 for mxfp8), or nullptr
  uint8_t* data_t;                   ///< [cols, rows], or nullptr without a column-wise copy
  void* scale_inv_t;                 ///< scales of data_t; per_tensor: nullptr when it is scale_inv
  const float* scale;                ///< per_tensor: the multiplier, f32[1]
  uint32_t* amax;                    ///< optional: raised to max|x| after every FP8 store
  bool x_vec, data_vec, data_t_vec;  ///< 16-byte vector accesses allowed (alignment, extents)
  bool power_of_2;                   ///< block modes: power-of-two scales
  /// Optional, with data_t: [tile_rows, cols], each tile's column sums in sum_rows' order
  /// (combine_row_partials finishes them).
  float* col_partials;
};

/// Parameters of dequantize over the stored copy's own [rows, cols] (blocks as the CPU's row-wise
/// BlockGrid: per_tensor is one rows x cols block).
struct DequantParams {
  const uint8_t* q;
  void* out;
  int64_t rows, cols;
  const void* scale_inv;  ///< f32, or e8m0 bits when e8m0
  int64_t block_rows, block_cols, scale_cols;
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
// Device pieces of the tile kernel

/// Copies the tile at (r0, c0) of x into shared memory; cells outside x become 0, which no amax
/// notices and no store writes back. Full, aligned chunks go by cp.async (8 or 16 per thread in
/// flight), the rest element by element.
template <typename T>
__device__ __forceinline__ void load_tile(const TileParams& p, T* tile, int64_t r0, int64_t c0) {
  using L = TileLayout<T>;
  static_assert(kTile * L::kChunksPerRow % kTileThreads == 0, "whole chunks per thread");
  const T* x = static_cast<const T*>(p.x);
#pragma unroll
  for (int i = 0; i < kTile * L::kChunksPerRow / kTileThreads; ++i) {
    const int idx = static_cast<int>(threadIdx.x) + i * kTileThreads;
    const int r = idx / L::kChunksPerRow, j = idx % L::kChunksPerRow;
    const int64_t gr = r0 + r, gc = c0 + static_cast<int64_t>(j) * L::kChunkElems;
    T* dst = tile + L::chunk_offset(r, j);
    if (p.x_vec && gr < p.rows && gc + L::kChunkElems <= p.cols) {
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

/// The 16-element run `run` of tile row r, as floats.
template <typename T>
__device__ __forceinline__ void read_row_run(const T* tile, int r, int run, float* v) {
  using L = TileLayout<T>;
#pragma unroll
  for (int k = 0; k < L::kChunksPerRun; ++k) {
    const uint4 u =
        *reinterpret_cast<const uint4*>(tile + L::chunk_offset(r, run * L::kChunksPerRun + k));
    unpack<T>(u, v + k * L::kChunkElems);
  }
}

/// Columns c and c + 1 (c even) of tile rows [r_begin, r_begin + 16), r_begin a multiple of 16.
template <typename T>
__device__ __forceinline__ void read_column_pair(const T* tile, int r_begin, int c, float* a,
                                                 float* b) {
  using L = TileLayout<T>;
  // One swizzle for the whole run (chunk_offset depends on r / 16 only): row k is k * kTile on.
  const T* pair = tile + L::chunk_offset(r_begin, c / L::kChunkElems) + c % L::kChunkElems;
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
    }
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
    read_row_run<T>(tile, r, run, v);
    float multiplier = tile_multiplier;
    if constexpr (kMode == ScalingMode::block_1x128) {
      const uint32_t m = run_amax_bits(v);
      amax_bits = max(amax_bits, m);
      const uint32_t block = lane_group_max<kRunsPerRow - 1>(m);  // the 8 lanes of row r
      multiplier = fp8::block_scale(fp8::bits_float(block), kFp8Max<kFp8>, p.power_of_2);
      if (run == 0 && gr < p.rows)
        static_cast<float*>(p.scale_inv)[gr * p.tile_cols + tj] = fp8::scale_inv_of(multiplier);
    } else if constexpr (kMode == ScalingMode::mxfp8_1x32) {
      const uint32_t m = run_amax_bits(v);
      amax_bits = max(amax_bits, m);
      const uint32_t block = lane_group_max<kRunsPerMx - 1>(m);  // the 2 lanes of a 32-block
      const uint8_t e = fp8::mxfp8_scale_inv(fp8::bits_float(block), kFp8Max<kFp8>);
      multiplier = fp8::mxfp8_multiplier(e);
      if (run % kRunsPerMx == 0 && gr < p.rows && gc < p.cols)
        static_cast<uint8_t*>(p.scale_inv)[gr * p.mx_cols + gc / kMx] = e;
    } else if constexpr (kMode == ScalingMode::per_tensor) {
      if (want_amax) amax_bits = max(amax_bits, run_amax_bits(v));
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
    read_column_pair<T>(tile, r, c, a, b);
    float mul_a = tile_multiplier, mul_b = tile_multiplier;
    if constexpr (kMode == ScalingMode::block_1x128) {
      const uint32_t ma = run_amax_bits(a), mb = run_amax_bits(b);
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
      const uint32_t ma = run_amax_bits(a), mb = run_amax_bits(b);
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
      if (want_amax) amax_bits = max(amax_bits, max(run_amax_bits(a), run_amax_bits(b)));
    }
    if (p.col_partials != nullptr) add_column_partials(p, ti, gc, pair, col_run, a, b);
    const uint4 qa = quantize_run<kFp8>(a, mul_a);
    const uint4 qb = quantize_run<kFp8>(b, mul_b);
    if (gc < p.cols) store_fp8_run(p.data_t + gc * p.rows + gr, p.rows - gr, p.data_t_vec, qa);
    if (gc + 1 < p.cols)
      store_fp8_run(p.data_t + (gc + 1) * p.rows + gr, p.rows - gr, p.data_t_vec, qb);
  }
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

/// Quantizes one 128x128 tile of x (blockIdx.x = tile, row-major over the tile grid) into the
/// row-wise and/or column-wise copy in scaling mode kMode, with their scales and optional amax.
/// Traffic per bf16 element: 2 B read, 1 B per copy written (4 B with both copies; 6 B for f32),
/// all as 16-byte coalesced accesses; shared memory is bank-conflict-free (TileLayout). Expect
/// >= 85% of copy bandwidth for per-tensor cast-transpose and >= 75% for the block modes at large
/// aligned shapes; edge tiles and unaligned shapes take the element-wise fallbacks.
template <typename T, ScalingMode kMode, DType kFp8>
__global__ void __launch_bounds__(kTileThreads) quantize_tile_kernel(const TileParams p) {
  extern __shared__ uint4 tile_smem[];  // TileLayout<T>::kBytes
  __shared__ uint32_t scratch[kTileWarps];
  T* tile = reinterpret_cast<T*>(tile_smem);
  const int64_t ti = blockIdx.x / p.tile_cols, tj = blockIdx.x % p.tile_cols;
  load_tile<T>(p, tile, ti * kTile, tj * kTile);

  uint32_t amax_bits = 0;   // this thread's max abs_bits(x), for p.amax
  float multiplier = 1.0f;  // per_tensor and block_128x128: the tile's one multiplier
  if constexpr (kMode == ScalingMode::per_tensor) {
    multiplier = *p.scale;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
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
      read_row_run<T>(tile, static_cast<int>(threadIdx.x) / kRunsPerRow + i * kRowsPerRowPass,
                      static_cast<int>(threadIdx.x) % kRunsPerRow, v);
      m = max(m, run_amax_bits(v));
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

/// out = decode(q) * scale_inv of q's block, as f32 or bf16, over 16-element runs of rows (a run
/// never straddles a block: block widths are multiples of 16). Reads 1 B + writes sizeof(TOut)
/// per element with 16-byte accesses when aligned; a memory-bound map.
template <typename TOut, DType kFp8>
__global__ void __launch_bounds__(kFlatThreads) dequantize_kernel(const DequantParams p) {
  const int64_t runs_per_row = (p.cols + kRunElems - 1) / kRunElems;
  const int64_t runs = p.rows * runs_per_row;
  TOut* out = static_cast<TOut*>(p.out);
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * kFlatThreads + threadIdx.x; s < runs;
       s += static_cast<int64_t>(gridDim.x) * kFlatThreads) {
    const int64_t r = s / runs_per_row, c = (s % runs_per_row) * kRunElems;
    const int64_t count = p.cols - c;
    const int64_t block = (r / p.block_rows) * p.scale_cols + c / p.block_cols;
    const float scale_inv = p.e8m0
                                ? fp8::decode_e8m0(static_cast<const uint8_t*>(p.scale_inv)[block])
                                : static_cast<const float*>(p.scale_inv)[block];
    const int64_t i = r * p.cols + c;
    uint32_t w[4] = {0, 0, 0, 0};
    if (p.vec && count >= kRunElems) {
      const uint4 u = *reinterpret_cast<const uint4*>(p.q + i);
      w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    } else {
#pragma unroll
      for (int e = 0; e < kRunElems; ++e)
        if (e < count) w[e / 4] |= static_cast<uint32_t>(p.q[i + e]) << (8 * (e % 4));
    }
    float v[kRunElems];
#pragma unroll
    for (int e = 0; e < kRunElems; ++e) {
      const uint8_t q = static_cast<uint8_t>(w[e / 4] >> (8 * (e % 4)));
      v[e] = mul_like_host(fp8::decode_fp8(q, kFp8), scale_inv);
    }
    store_run<TOut>(out + i, count, p.vec, v);
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

/// Calls f(T{}) with the element type of a high-precision dtype: float, or uint16_t bf16 bits.
template <typename F>
void visit_input(DType dtype, F&& f) {
  if (dtype == DType::f32) {
    f(float{});
  } else {
    f(uint16_t{});
  }
}

/// Calls f with the FP8 dtype as a compile-time constant.
template <typename F>
void visit_fp8(DType dtype, F&& f) {
  if (dtype == DType::e4m3) {
    f(std::integral_constant<DType, DType::e4m3>{});
  } else {
    f(std::integral_constant<DType, DType::e5m2>{});
  }
}

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

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// The tensor's data, or nullptr when it is undefined.
template <typename T>
T* data_or_null(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.raw_data()) : nullptr;
}

/// Dynamic shared memory a kernel may use without opting in (all architectures since sm_70).
constexpr int kDefaultDynamicSmemBytes = 48 * 1024;

template <typename T, ScalingMode kMode, DType kFp8>
void launch_quantize_tile(const TileParams& p, const Device& device, cudaStream_t stream) {
  constexpr int kSmemBytes = TileLayout<T>::kBytes;
  const auto kernel = quantize_tile_kernel<T, kMode, kFp8>;
  if constexpr (kSmemBytes > kDefaultDynamicSmemBytes) {
    // f32 tiles (64 KiB) need the opt-in, once per device (the attribute is per device); a
    // race between two threads only sets the same value twice.
    static std::atomic<uint64_t> opted_in{0};
    const uint64_t bit = device.index < 64 ? uint64_t{1} << device.index : 0;
    if (bit == 0 || (opted_in.load(std::memory_order_relaxed) & bit) == 0) {
      OCTET_CHECK_CUDA(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
      opted_in.fetch_or(bit, std::memory_order_relaxed);
    }
  }
  const int64_t tiles = p.tile_rows * p.tile_cols;
  OCTET_CHECK(tiles <= INT_MAX, "quantize: a [", p.rows, ", ", p.cols, "] matrix has ", tiles,
              " tiles of ", kTile, "x", kTile, "; expected at most ", INT_MAX, " (gridDim.x)");
  kernel<<<static_cast<unsigned>(tiles), kTileThreads, kSmemBytes, stream>>>(p);
  OCTET_CHECK_LAUNCH();
}

}  // namespace
}  // namespace quant

void amax(const Tensor& x, const Tensor& amax_out) {
  const Device device = x.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const int64_t n = x.numel();
  auto* amax_bits = static_cast<uint32_t*>(amax_out.raw_data());
  quant::visit_input(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(x.raw_data());
    const int grid = quant::flat_grid(quant::ceil_div(n, quant::kRunElems), device);
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

  if (out.mode == ScalingMode::per_tensor && !out.has_columnwise()) {
    // No transpose: a streaming map over the flat matrix.
    const int64_t n = rows * cols;
    auto* data = static_cast<uint8_t*>(out.data.raw_data());
    auto* scale_inv = static_cast<float*>(out.scale_inv.raw_data());
    const int grid = quant::flat_grid(quant::ceil_div(n, quant::kRunElems), device);
    quant::visit_input(x.dtype(), [&](auto in_tag) {
      using T = decltype(in_tag);
      const T* xp = static_cast<const T*>(x.raw_data());
      const bool vec = quant::vec_aligned(xp) && quant::vec_aligned(data);
      quant::visit_fp8(out.dtype, [&](auto fp8_tag) {
        quant::quantize_per_tensor_kernel<T, decltype(fp8_tag)::value>
            <<<grid, quant::kFlatThreads, 0, stream>>>(xp, n, vec, scale, data, scale_inv,
                                                       amax_bits);
        OCTET_CHECK_LAUNCH();
      });
    });
    if (args.column_sums.defined()) sum_rows(x, args.column_sums, /*accumulate=*/true);
    return;
  }

  quant::TileParams p{};
  p.x = x.raw_data();
  p.rows = rows;
  p.cols = cols;
  p.tile_rows = quant::ceil_div(rows, quant::kTile);
  p.tile_cols = quant::ceil_div(cols, quant::kTile);
  p.mx_rows = quant::ceil_div(rows, quant::kMx);
  p.mx_cols = quant::ceil_div(cols, quant::kMx);
  p.data = quant::data_or_null<uint8_t>(out.data);
  p.scale_inv = p.data != nullptr ? out.scale_inv.raw_data() : nullptr;
  p.data_t = quant::data_or_null<uint8_t>(out.data_t);
  p.scale_inv_t = p.data_t != nullptr ? out.scale_inv_t.raw_data() : nullptr;
  // per_tensor with both copies usually shares one scale_inv tensor: write it once.
  if (out.mode == ScalingMode::per_tensor && p.scale_inv_t == p.scale_inv) p.scale_inv_t = nullptr;
  p.scale = scale;
  p.amax = amax_bits;
  p.data_vec = p.data != nullptr && quant::vec_aligned(p.data) && cols % quant::kRunElems == 0;
  p.data_t_vec =
      p.data_t != nullptr && quant::vec_aligned(p.data_t) && rows % quant::kRunElems == 0;
  p.power_of_2 = args.power_of_2_block_scales;
  // Column sums ride on the column pass; without a transposed copy, sum_rows reads x again.
  Tensor col_partials;  // stream-ordered workspace, freed after the kernels that use it
  if (args.column_sums.defined() && p.data_t != nullptr) {
    col_partials = Tensor::empty({p.tile_rows, cols}, DType::f32, device);
    p.col_partials = col_partials.data<float>();
  }
  quant::visit_input(x.dtype(), [&](auto in_tag) {
    using T = decltype(in_tag);
    p.x_vec = quant::vec_aligned(p.x) && cols % quant::kVecElems<T> == 0;
    quant::visit_mode(out.mode, [&](auto mode_tag) {
      quant::visit_fp8(out.dtype, [&](auto fp8_tag) {
        quant::launch_quantize_tile<T, decltype(mode_tag)::value, decltype(fp8_tag)::value>(
            p, device, stream);
      });
    });
  });
  if (col_partials.defined()) {
    combine_row_partials(col_partials, args.column_sums, /*accumulate=*/true);
  } else if (args.column_sums.defined()) {
    sum_rows(x, args.column_sums, /*accumulate=*/true);
  }
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
  p.scale_cols = quant::ceil_div(p.cols, p.block_cols);
  p.e8m0 = q.mode == ScalingMode::mxfp8_1x32;
  p.vec = quant::vec_aligned(p.q) && quant::vec_aligned(p.out) && p.cols % quant::kRunElems == 0;
  const int grid = quant::flat_grid(p.rows * quant::ceil_div(p.cols, quant::kRunElems), device);
  quant::visit_input(out.dtype(), [&](auto out_tag) {
    using TOut = decltype(out_tag);
    quant::visit_fp8(q.dtype, [&](auto fp8_tag) {
      quant::dequantize_kernel<TOut, decltype(fp8_tag)::value>
          <<<grid, quant::kFlatThreads, 0, stream>>>(p);
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
  const int grid = quant::flat_grid(quant::ceil_div(n, quant::kRunElems), device);
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
  quant::visit_input(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = static_cast<const T*>(x.raw_data());
    const int grid = quant::flat_grid(quant::ceil_div(n, quant::kRunElems), device);
    quant::count_fp8_codes_kernel<T>
        <<<grid, quant::kFlatThreads, 0, stream>>>(p, c, n, quant::vec_aligned(p), max_code, out);
    OCTET_CHECK_LAUNCH();
  });
}

}  // namespace octet::ops::cuda
