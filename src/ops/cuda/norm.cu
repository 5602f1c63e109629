// CUDA LayerNorm and RMSNorm, forward and backward. One group of threads per row (a warp or
// more, several rows per CTA when rows are short), 16-byte packed loads and stores when the row
// length and the pointers allow, the scalar formulas of activation_math.h.
//
// In the forward, rows of at most kWarpRowMaxPacks 16-byte packs per lane (2048 bf16 or 1024 f32
// columns: every GPT-2 and Llama width octet trains) take the warp-row kernel: one warp per row,
// the row held in registers, every load issued before the first use, and warp-shuffle reductions
// with no CTA barrier per row. Longer or unaligned rows take the general kernel. (A warp-row
// backward, holding dy and x of a row in registers, is slower than the general backward: its 186
// registers leave one CTA of 8 warps per SM; docs/PERFORMANCE.md, "Designs that measured
// slower".)
//
// Forward: the row is read from global memory once, kept as f32 (registers, or shared memory in
// the general kernel), and reduced twice (mean, then the sum of squares around it), then
// normalized; the fused FP8 cast of y happens in the same pass that stores y.
// Backward: each CTA walks one tile of rows; per row it reduces mean(dxhat) and mean(dxhat *
// xhat), writes dx, and adds dy * xhat and dy into per-column accumulators in shared memory. A
// CTA's accumulators go to its own slot of a scratch buffer, and a second kernel sums the slots
// in tile order into dgamma and dbeta: a fixed order, no float atomics (DESIGN.md rule 3). The
// tiling depends on the shape only, so a shape always reduces in the same order.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "octet/core/cuda_context.h"
#include "ops/activation_math.h"
#include "ops/cuda/fp8_kernels.cuh"
#include "ops/cuda/fused_cast.cuh"
#include "ops/cuda/launch_util.cuh"
#include "ops/norm_backend.h"

namespace octet::ops::cuda {
namespace {

/// Threads per CTA when a row needs fewer: the CTA then holds several rows.
constexpr int kCtaThreads = 256;
/// Elements per thread a row's thread group is sized for: two 16-byte packs of bf16.
constexpr int64_t kElementsPerThread = 16;
/// A row's thread group is at most one full CTA.
constexpr int kMaxThreadsPerRow = 1024;
/// Rows per CTA are at most kCtaThreads / 32 (a warp per row).
constexpr int kMaxRowsPerCta = kCtaThreads / kWarpSize;
/// Backward: the number of row tiles (CTAs, and dgamma/dbeta partial rows) aimed for. More tiles
/// put more rows in flight; each costs 16 bytes per column of scratch traffic (the partials
/// written and read back), 17% of the bf16 traffic (dy and x read, dx written: 6 bytes per
/// element) when a tile holds 16 rows. At 256 tiles (GPT-2 1.5B, 8192 x 1600: 2 CTAs per SM) the
/// per-row reductions' latency, not bandwidth, bounds the kernel (at about a third of the rate
/// its bytes allow; docs/PERFORMANCE.md, "Designs that measured slower"); 512 tiles double the
/// rows in flight.
constexpr int64_t kTargetTiles = 512;
/// Room left for the kernels' static shared memory (reduction scratch, about 2.2 KiB) when
/// opting into more dynamic shared memory.
constexpr size_t kStaticSmemReserve = 4 * 1024;
/// Column sums: a CTA covers 32 columns (one coalesced 128-byte row segment) with
/// kColumnChunks threads per column, each summing a fixed contiguous chunk of the tiles.
constexpr int kColumnChunks = 8;
/// Column sums: tile partials a thread loads before adding them (in tile order).
constexpr int kColumnLoadsInFlight = 8;
/// Warp-row kernels: warps per CTA, and the most 16-byte packs a lane holds.
constexpr int kWarpRowWarps = 8;
constexpr int kWarpRowMaxPacks = 8;
/// Warp-row forward with the transposed FP8 copy: rows per CTA tile, so that each column of the
/// tile is one 32-byte sector of the transposed copy. The tile's codes are staged in shared
/// memory (32 bytes per column: 51 KB at GPT-2 1.5B's 1600 columns).
constexpr int kTransposeTileRows = 32;

/// Threads per row and rows per CTA; a function of the row length only, so that the order of
/// every reduction depends on the shape alone.
struct NormLayout {
  int threads_per_row;
  int rows_per_cta;
};

NormLayout layout_for(int64_t cols) {
  const int64_t warps = ceil_div(ceil_div(cols, kElementsPerThread), kWarpSize);
  const int threads =
      static_cast<int>(std::clamp<int64_t>(warps * kWarpSize, kWarpSize, kMaxThreadsPerRow));
  return {threads, std::max(1, kCtaThreads / threads)};
}

// ----------------------------------------------------------------------------
// CUDA kernels

/// Lane `lane`'s packs of a row of `packs` packs: pack i of the lane is row pack lane + 32 i.
template <int kPacks>
struct WarpRow {
  static_assert(kPacks >= 1 && kPacks <= kWarpRowMaxPacks, "packs per lane");
  int64_t packs;
  int lane;
  __device__ bool valid(int i) const { return lane + static_cast<int64_t>(i) * kWarpSize < packs; }
  __device__ int64_t pack(int i) const { return lane + static_cast<int64_t>(i) * kWarpSize; }
};

/// Loads the lane's packs of `row` (16-byte loads, all issued before any use); invalid packs
/// are zeros.
template <int kPacks, typename T, int kN>
__device__ __forceinline__ void load_row(const WarpRow<kPacks>& w, const T* row,
                                         Pack<T, kN> (&v)[kPacks]) {
#pragma unroll
  for (int i = 0; i < kPacks; ++i) {
    if (w.valid(i)) {
      v[i] = load_pack<kN>(row + w.pack(i) * kN);
    } else {
#pragma unroll
      for (int k = 0; k < kN; ++k) v[i].v[k] = T(0);
    }
  }
}

/// Writes the transposed FP8 copy of a tile of kTransposeTileRows rows from its row-major codes
/// in shared memory: thread t takes columns t, t + blockDim, ...; each column's 32 codes are
/// one 32-byte sector of data_t [cols, rows] (two 16-byte stores when the tile is whole and
/// aligned, else byte stores of the valid rows).
__device__ __forceinline__ void store_transposed_tile(const uint8_t* stage, uint8_t* data_t,
                                                      int64_t r0, int64_t rows, int64_t cols) {
  static_assert(kTransposeTileRows == 32, "a tile column is two 16-byte stores of 8 words");
  const int64_t valid = min(static_cast<int64_t>(kTransposeTileRows), rows - r0);
  const bool vec = valid == kTransposeTileRows && rows % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(data_t) % 16 == 0;
  const int threads = blockDim.x * blockDim.y;
  for (int64_t c = threadIdx.y * blockDim.x + threadIdx.x; c < cols; c += threads) {
    uint8_t* dst = data_t + c * rows + r0;
    if (vec) {
      uint32_t word[kTransposeTileRows / 4];
#pragma unroll
      for (int q = 0; q < kTransposeTileRows / 4; ++q) {
        // Consecutive threads read consecutive bytes of one tile row: no bank conflicts.
        word[q] = quant::gather_column_word(stage + (4 * q) * cols + c, cols);
      }
      reinterpret_cast<uint4*>(dst)[0] = make_uint4(word[0], word[1], word[2], word[3]);
      reinterpret_cast<uint4*>(dst)[1] = make_uint4(word[4], word[5], word[6], word[7]);
    } else {
      for (int64_t rr = 0; rr < valid; ++rr) dst[rr] = stage[rr * cols + c];
    }
  }
}

/// norm_forward_kernel for rows that fit a warp's registers: block (32, kWarpRowWarps), warp y
/// normalizes rows y, y + kWarpRowWarps, ... of the CTA's tile (1 row, or kTransposeTileRows /
/// kWarpRowWarps with kTransposed). Each lane sums its elements in pack order, then a butterfly
/// sums the lanes: the order depends on the row length only. kTransposed: the cast's transposed
/// copy too, from the tile's codes staged in dynamic shared memory [kTransposeTileRows, cols];
/// y is stored only if the cast wants it (FusedCast::y_wanted).
template <typename T, int kN, int kPacks, bool kRms, bool kTransposed>
__global__ void __launch_bounds__(kWarpSize* kWarpRowWarps)
    norm_forward_warp_row_kernel(const T* __restrict__ x, const float* __restrict__ gamma,
                                 const float* __restrict__ beta, float eps, T* y, float* mean_out,
                                 float* rstd_out, int64_t rows, int64_t cols, FusedCast cast) {
  extern __shared__ uint4 stage_raw[];  // kTransposed: the tile's FP8 codes, row-major
  __shared__ uint32_t amax_scratch[kWarpSize];
  constexpr int kRowsPerWarp = kTransposed ? kTransposeTileRows / kWarpRowWarps : 1;
  constexpr int64_t kTileRows = kRowsPerWarp * kWarpRowWarps;
  uint8_t* stage = reinterpret_cast<uint8_t*>(stage_raw);
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  T* y_out = cast.enabled() && !cast.y_wanted ? nullptr : y;
  const auto add = [](float a, float b) { return a + b; };
  const float n = static_cast<float>(cols);
  CastThread ct(cast);
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int tile_row = static_cast<int>(threadIdx.y) + j * kWarpRowWarps;
    const int64_t r = r0 + tile_row;
    const bool active = r < rows;  // an idle warp still joins the CTA's barriers below
    const WarpRow<kPacks> w{active ? cols / kN : 0, static_cast<int>(threadIdx.x)};
    Pack<T, kN> v[kPacks];
    load_row<kPacks, T, kN>(w, x + (active ? r : 0) * cols, v);

    float first = 0.0f;
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const float f = math::to_float(v[i].v[k]);
        first += kRms ? f * f : f;  // zeros past the row add nothing
      }
    }
    first = warp_reduce(first, add) / n;
    float mean = 0.0f, var = first;
    if constexpr (!kRms) {
      mean = first;
      float squares = 0.0f;
#pragma unroll
      for (int i = 0; i < kPacks; ++i) {
        if (!w.valid(i)) continue;
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          const float d = math::to_float(v[i].v[k]) - mean;
          squares += d * d;
        }
      }
      var = warp_reduce(squares, add) / n;
    }
    const float rstd = math::norm_rstd(var, eps);

#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      if (!w.valid(i)) continue;
      const int64_t c = w.pack(i) * kN;
      const Pack<float, kN> g = load_pack<kN>(gamma + c);
      Pack<float, kN> b;
      if constexpr (kRms) {
#pragma unroll
        for (int k = 0; k < kN; ++k) b.v[k] = 0.0f;
      } else {
        b = load_pack<kN>(beta + c);
      }
      float out[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k)
        out[k] = math::norm_output(math::to_float(v[i].v[k]), mean, rstd, g.v[k], b.v[k]);
      const Pack<uint8_t, kN> q = store_output<T, kN>(y_out, r * cols + c, out, ct);
      if constexpr (kTransposed) store_pack<kN>(stage + tile_row * cols + c, q);
    }
    if (active && threadIdx.x == 0) {
      if constexpr (!kRms) mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  }
  if constexpr (kTransposed) {
    __syncthreads();  // the tile's codes are staged
    store_transposed_tile(stage, cast.data_t, r0, rows, cols);
  }
  finish_cast(ct, amax_scratch);  // after every store of both copies (DESIGN.md rule 1)
}

/// Sums both components over the thread group of one row (threadIdx.y) in a fixed order; every
/// thread of the group gets the sums. Contains barriers: every thread of the CTA calls it.
__device__ float2 row_sum2(float2 v, float2* shared) {
  const auto add = [](float a, float b) { return a + b; };
  v.x = warp_reduce(v.x, add);
  v.y = warp_reduce(v.y, add);
  const int lane = threadIdx.x % kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  float2* group = shared + threadIdx.y * kWarpSize;
  __syncthreads();  // the previous reduction may still read `shared`
  if (lane == 0) group[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float2 s = lane < warps ? group[lane] : make_float2(0.0f, 0.0f);
  s.x = warp_reduce(s.x, add);
  s.y = warp_reduce(s.y, add);
  return s;
}

/// The kN values of pack p of a row as f32: from the shared-memory copy when there is one.
template <typename T, int kN>
__device__ __forceinline__ Pack<float, kN> row_pack(const T* row, const float* cached, int64_t p) {
  if (cached != nullptr) return load_pack<kN>(cached + p * kN);  // 16-byte shared accesses
  const Pack<T, kN> v = load_pack<kN>(row + p * kN);
  Pack<float, kN> f;
#pragma unroll
  for (int k = 0; k < kN; ++k) f.v[k] = math::to_float(v.v[k]);
  return f;
}

/// One row per thread group. Block (threads_per_row, rows_per_cta); dynamic shared memory holds
/// the rows as f32 when cache_rows. kN = elements per pack (1: unvectorized). RMSNorm: no beta,
/// no mean, statistics around 0.
template <typename T, int kN, bool kRms>
__global__ void norm_forward_kernel(const T* __restrict__ x, const float* __restrict__ gamma,
                                    const float* __restrict__ beta, float eps, T* y,
                                    float* mean_out, float* rstd_out, int64_t rows, int64_t cols,
                                    bool cache_rows, FusedCast cast) {
  extern __shared__ float4 row_cache[];  // float4: 16-byte aligned for the packs
  __shared__ float2 sums[kMaxRowsPerCta * kWarpSize];
  __shared__ uint32_t amax_scratch[kWarpSize];
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = r < rows;  // an idle group still joins the CTA's barriers
  const int64_t packs = cols / kN;
  const float n = static_cast<float>(cols);
  const T* xr = x + (active ? r : 0) * cols;
  float* cached = cache_rows ? reinterpret_cast<float*>(row_cache) + threadIdx.y * cols : nullptr;

  // Pass 1 reads the row from global memory, keeping the shared copy; RMSNorm needs only this.
  float first_sum = 0.0f;
  for (int64_t p = threadIdx.x; active && p < packs; p += blockDim.x) {
    const Pack<float, kN> f = row_pack<T, kN>(xr, nullptr, p);
    if (cached != nullptr) store_pack<kN>(cached + p * kN, f);
#pragma unroll
    for (int k = 0; k < kN; ++k) first_sum += kRms ? f.v[k] * f.v[k] : f.v[k];
  }
  // LayerNorm: pass 1 gave the mean, and pass 2 sums squares around it (two-pass variance).
  // RMSNorm: pass 1 gave the mean square.
  const float first = row_sum2(make_float2(first_sum, 0.0f), sums).x / n;
  float mean = 0.0f, var = first;
  if constexpr (!kRms) {
    mean = first;
    float squares = 0.0f;
    for (int64_t p = threadIdx.x; active && p < packs; p += blockDim.x) {
      const Pack<float, kN> f = row_pack<T, kN>(xr, cached, p);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const float d = f.v[k] - mean;
        squares += d * d;
      }
    }
    var = row_sum2(make_float2(squares, 0.0f), sums).x / n;
  }
  const float rstd = math::norm_rstd(var, eps);

  CastThread ct(cast);
  for (int64_t p = threadIdx.x; active && p < packs; p += blockDim.x) {
    const Pack<float, kN> f = row_pack<T, kN>(xr, cached, p);
    const Pack<float, kN> g = load_pack<kN>(gamma + p * kN);
    Pack<float, kN> b;
    if constexpr (kRms) {
#pragma unroll
      for (int k = 0; k < kN; ++k) b.v[k] = 0.0f;
    } else {
      b = load_pack<kN>(beta + p * kN);
    }
    float out[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) out[k] = math::norm_output(f.v[k], mean, rstd, g.v[k], b.v[k]);
    store_output<T, kN>(y, r * cols + p * kN, out, ct);
  }
  if (active && threadIdx.x == 0) {
    if constexpr (!kRms) mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
  finish_cast(ct, amax_scratch);
}

/// One tile of rows_per_tile rows per CTA, each thread group (threadIdx.y) taking every
/// blockDim.y-th row of the tile. Column accumulators (dgamma, then dbeta for LayerNorm) live in
/// dynamic shared memory per group when acc_in_smem, and are combined in group order into the
/// tile's slot of `partials` [tiles, sums, cols]; otherwise (rows too long; one group per CTA)
/// they accumulate in that slot directly.
template <typename T, int kN, bool kRms>
__global__ void norm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                     const float* __restrict__ gamma,
                                     const float* __restrict__ mean, const float* __restrict__ rstd,
                                     const T* residual, T* dx, float* partials, int64_t rows,
                                     int64_t cols, int64_t rows_per_tile, bool acc_in_smem) {
  constexpr int kSums = kRms ? 1 : 2;
  extern __shared__ float4 acc_raw[];  // float4: 16-byte aligned for the packs
  __shared__ float2 sums[kMaxRowsPerCta * kWarpSize];
  float* acc_smem = reinterpret_cast<float*>(acc_raw);
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * rows_per_tile;
  const int64_t r1 = min(rows, r0 + rows_per_tile);
  const int64_t packs = cols / kN;
  const float n = static_cast<float>(cols);
  float* tile_partial = partials + static_cast<int64_t>(blockIdx.x) * kSums * cols;
  float* acc = acc_in_smem ? acc_smem + threadIdx.y * kSums * cols : tile_partial;

  // Each thread owns the same columns in every row, so its accumulators need no barrier.
  Pack<float, kN> zero;
#pragma unroll
  for (int k = 0; k < kN; ++k) zero.v[k] = 0.0f;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
#pragma unroll
    for (int j = 0; j < kSums; ++j) store_pack<kN>(acc + j * cols + p * kN, zero);
  }
  const int64_t iterations = ceil_div(r1 - r0, static_cast<int64_t>(blockDim.y));
  for (int64_t it = 0; it < iterations; ++it) {
    const int64_t r = r0 + it * blockDim.y + threadIdx.y;
    const bool active = r < r1;
    const T* dyr = dy + (active ? r : 0) * cols;
    const T* xr = x + (active ? r : 0) * cols;
    const float m = kRms || !active ? 0.0f : mean[r];
    const float s = active ? rstd[r] : 0.0f;
    float2 sum = make_float2(0.0f, 0.0f);  // dxhat, dxhat * xhat
    for (int64_t p = threadIdx.x; active && p < packs; p += blockDim.x) {
      const Pack<float, kN> g = row_pack<T, kN>(dyr, nullptr, p);
      const Pack<float, kN> xv = row_pack<T, kN>(xr, nullptr, p);
      const Pack<float, kN> w = load_pack<kN>(gamma + p * kN);
      Pack<float, kN> acc_g = load_pack<kN>(acc + p * kN), acc_b;
      if constexpr (!kRms) acc_b = load_pack<kN>(acc + cols + p * kN);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const float xhat = math::norm_xhat(xv.v[k], m, s);
        const float dxhat = g.v[k] * w.v[k];
        sum.x += dxhat;
        sum.y += dxhat * xhat;
        acc_g.v[k] += g.v[k] * xhat;
        if constexpr (!kRms) acc_b.v[k] += g.v[k];
      }
      store_pack<kN>(acc + p * kN, acc_g);
      if constexpr (!kRms) store_pack<kN>(acc + cols + p * kN, acc_b);
    }
    sum = row_sum2(sum, sums);
    const float mean_dxhat = kRms ? 0.0f : sum.x / n;
    const float mean_dxhat_xhat = sum.y / n;
    CastThread no_cast(FusedCast{});
    // The second pass re-reads the row: this thread's own elements, just read, so L1/L2 hits.
    for (int64_t p = threadIdx.x; active && p < packs; p += blockDim.x) {
      const Pack<float, kN> g = row_pack<T, kN>(dyr, nullptr, p);
      const Pack<float, kN> xv = row_pack<T, kN>(xr, nullptr, p);
      const Pack<float, kN> w = load_pack<kN>(gamma + p * kN);
      float out[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        out[k] = math::norm_dx(g.v[k] * w.v[k], math::norm_xhat(xv.v[k], m, s), s, mean_dxhat,
                               mean_dxhat_xhat);
      }
      if (residual != nullptr) {  // as ops::add would: the rounded gradient plus the residual
        const Pack<float, kN> res = row_pack<T, kN>(residual + r * cols, nullptr, p);
        const Pack<T, kN> rounded = round_pack<T>(out);
#pragma unroll
        for (int k = 0; k < kN; ++k)  // __fadd_rn: never contracted with norm_dx's multiply
          out[k] = __fadd_rn(math::to_float(rounded.v[k]), res.v[k]);
      }
      store_output<T, kN>(dx, r * cols + p * kN, out, no_cast);
    }
  }
  if (acc_in_smem) {
    __syncthreads();
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int groups = blockDim.y;
    for (int64_t i = tid; i < kSums * cols; i += blockDim.x * blockDim.y) {
      float v = 0.0f;
      for (int gi = 0; gi < groups; ++gi) v += acc_smem[gi * kSums * cols + i];
      tile_partial[i] = v;
    }
  }
}

/// out[j][c] (+)= the sum over tiles, in tile order, of partials[tile][j][c] (j: dgamma, dbeta);
/// without `accumulate`, out is 0 + the sum (bitwise what zeroing it first gives).
/// Block (32, kColumnChunks): threadIdx.x picks the column, threadIdx.y a fixed chunk of tiles;
/// the chunks are then added in chunk order, so the order depends on the tile count only.
__global__ void column_sums_kernel(const float* __restrict__ partials, int64_t tiles, int sums,
                                   int64_t cols, float* dgamma, float* dbeta, bool accumulate) {
  __shared__ float chunk_sums[kColumnChunks][kWarpSize];
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpSize + threadIdx.x;  // j * cols + c
  const bool valid = i < sums * cols;
  const int64_t per_chunk = ceil_div(tiles, kColumnChunks);
  const int64_t t0 = threadIdx.y * per_chunk;
  const int64_t t1 = min(tiles, t0 + per_chunk);
  float v = 0.0f;
  int64_t t = t0;
  for (; valid && t + kColumnLoadsInFlight <= t1; t += kColumnLoadsInFlight) {
    float loaded[kColumnLoadsInFlight];  // all loads issued first, then added in tile order
#pragma unroll
    for (int j = 0; j < kColumnLoadsInFlight; ++j) loaded[j] = partials[(t + j) * sums * cols + i];
#pragma unroll
    for (int j = 0; j < kColumnLoadsInFlight; ++j) v += loaded[j];
  }
  for (; valid && t < t1; ++t) v += partials[t * sums * cols + i];
  chunk_sums[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.y != 0 || !valid) return;
  float total = 0.0f;
#pragma unroll
  for (int chunk = 0; chunk < kColumnChunks; ++chunk) total += chunk_sums[chunk][threadIdx.x];
  float* out = i < cols ? dgamma + i : dbeta + (i - cols);
  *out = (accumulate ? *out : 0.0f) + total;  // one add into the accumulated gradient
}

// ----------------------------------------------------------------------------
// kernel launchers

/// Dynamic shared memory a kernel may opt into on `device`.
size_t smem_budget(const Device& device) {
  return octet::cuda::properties(device).sharedMemPerBlockOptin - kStaticSmemReserve;
}

/// Lets `kernel` use `bytes` of dynamic shared memory (an opt-in above 48 KiB).
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= kDefaultDynamicSmemBytes) return;
  OCTET_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
}

/// The tensor's data, or nullptr when it is undefined.
const void* ptr_or_null(const Tensor& t) { return t.defined() ? t.raw_data() : nullptr; }

/// Calls f(std::integral_constant<int, kPacks>{}) with the fewest packs per lane (1, 2, 4 or 8)
/// that hold a row of `packs` 16-byte packs in one warp; returns false (calling nothing) when the
/// row is longer than kWarpRowMaxPacks per lane.
template <typename F>
bool visit_warp_row_packs(int64_t packs, F&& f) {
  static_assert(kWarpRowMaxPacks == 8, "the cases below cover 1 to 8 packs per lane");
  const int64_t per_lane = ceil_div(packs, kWarpSize);
  if (per_lane > kWarpRowMaxPacks) return false;
  if (per_lane <= 1) {
    f(std::integral_constant<int, 1>{});
  } else if (per_lane <= 2) {
    f(std::integral_constant<int, 2>{});
  } else if (per_lane <= 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
  return true;
}

/// The warp-row forward when the row fits (vectorized rows only); false otherwise. With the
/// cast's transposed copy requested, the kernel writes it when its staging tile fits in shared
/// memory (`transposed` says whether it did); otherwise the cast goes without it.
template <typename T, int kN, bool kRms>
bool launch_forward_warp_row(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                             const Tensor& y, const Tensor& mean, const Tensor& rstd,
                             const FusedCast& cast, bool& transposed) {
  transposed = false;
  if constexpr (kN == 1) {
    return false;
  } else {
    const Device& device = x.device();
    const int64_t rows = x.rows(), cols = x.cols();
    const size_t stage_bytes = static_cast<size_t>(kTransposeTileRows * cols);
    const bool with_transposed = cast.enabled() && cast.data_t != nullptr &&
                                 stage_bytes <= smem_budget(device) &&
                                 ceil_div(rows, kTransposeTileRows) <= INT32_MAX;
    if (!with_transposed && ceil_div(rows, kWarpRowWarps) > INT32_MAX) return false;
    const FusedCast kernel_cast = with_transposed ? cast : cast.rowwise_only();
    const auto launch = [&](auto kernel, int64_t tile_rows, size_t smem) {
      kernel<<<static_cast<unsigned>(ceil_div(rows, tile_rows)), dim3(kWarpSize, kWarpRowWarps),
               smem, octet::cuda::stream(device)>>>(
          static_cast<const T*>(x.raw_data()), gamma.data<float>(),
          kRms ? nullptr : beta.data<float>(), eps, static_cast<T*>(y.raw_data()),
          kRms ? nullptr : mean.data<float>(), rstd.data<float>(), rows, cols, kernel_cast);
      OCTET_CHECK_LAUNCH();
    };
    const bool fits = visit_warp_row_packs(cols / kN, [&](auto packs) {
      constexpr int kPacks = decltype(packs)::value;
      if (with_transposed) {
        const auto kernel = norm_forward_warp_row_kernel<T, kN, kPacks, kRms, true>;
        // The staging tile's size follows cols: opt in to the whole budget, once per device, so
        // a forward costs no cudaFuncSetAttribute.
        static octet::cuda::PerDeviceFlag opted_in;
        if (!opted_in.test(device)) {
          allow_smem(kernel, smem_budget(device));
          opted_in.set(device);
        }
        launch(kernel, kTransposeTileRows, stage_bytes);
      } else {
        launch(norm_forward_warp_row_kernel<T, kN, kPacks, kRms, false>, kWarpRowWarps, 0);
      }
    });
    transposed = fits && with_transposed;
    return fits;
  }
}

/// Returns whether the cast's transposed copy was written.
template <typename T, int kN, bool kRms>
bool launch_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                    const Tensor& y, const Tensor& mean, const Tensor& rstd,
                    const FusedCast& cast) {
  bool transposed = false;
  if (launch_forward_warp_row<T, kN, kRms>(x, gamma, beta, eps, y, mean, rstd, cast, transposed))
    return transposed;
  const Device& device = x.device();
  const int64_t rows = x.rows(), cols = x.cols();
  const NormLayout layout = layout_for(cols);
  const size_t cache_bytes = sizeof(float) * layout.rows_per_cta * cols;
  const bool cache_rows = cache_bytes <= smem_budget(device);
  const size_t smem = cache_rows ? cache_bytes : 0;
  auto kernel = norm_forward_kernel<T, kN, kRms>;
  allow_smem(kernel, smem);
  const int64_t blocks = ceil_div(rows, layout.rows_per_cta);
  OCTET_CHECK(blocks <= INT32_MAX, "norm forward: ", rows, " rows exceed the grid limit");
  const dim3 block(layout.threads_per_row, layout.rows_per_cta);
  kernel<<<static_cast<unsigned>(blocks), block, smem, octet::cuda::stream(device)>>>(
      static_cast<const T*>(x.raw_data()), gamma.data<float>(), kRms ? nullptr : beta.data<float>(),
      eps, static_cast<T*>(y.raw_data()), kRms ? nullptr : mean.data<float>(), rstd.data<float>(),
      rows, cols, cache_rows, cast.rowwise_only());
  OCTET_CHECK_LAUNCH();
  return false;
}

template <typename T, int kN, bool kRms>
void launch_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                     const Tensor& rstd, const Tensor& dx, const Tensor& dgamma,
                     const Tensor& dbeta, const Tensor& residual, bool accumulate) {
  constexpr int kSums = kRms ? 1 : 2;
  const Device& device = x.device();
  const cudaStream_t stream = octet::cuda::stream(device);
  const int64_t rows = x.rows(), cols = x.cols();
  NormLayout layout = layout_for(cols);
  size_t acc_bytes = sizeof(float) * kSums * layout.rows_per_cta * cols;
  const bool acc_in_smem = acc_bytes <= smem_budget(device);
  if (!acc_in_smem) {
    layout.rows_per_cta = 1;  // accumulating straight into the tile's slot: one group per CTA
    acc_bytes = 0;
  }
  const int64_t rows_per_tile =
      layout.rows_per_cta *
      std::max<int64_t>(1, ceil_div(rows, layout.rows_per_cta * kTargetTiles));
  const int64_t tiles = ceil_div(rows, rows_per_tile);
  OCTET_CHECK(tiles <= INT32_MAX, "norm backward: ", tiles, " row tiles exceed the grid limit");
  Tensor partials = Tensor::empty({tiles, kSums, cols}, DType::f32, device);

  auto kernel = norm_backward_kernel<T, kN, kRms>;
  allow_smem(kernel, acc_bytes);
  const dim3 block(layout.threads_per_row, layout.rows_per_cta);
  kernel<<<static_cast<unsigned>(tiles), block, acc_bytes, stream>>>(
      static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()),
      gamma.data<float>(), kRms ? nullptr : mean.data<float>(), rstd.data<float>(),
      static_cast<const T*>(ptr_or_null(residual)), static_cast<T*>(dx.raw_data()),
      partials.data<float>(), rows, cols, rows_per_tile, acc_in_smem);
  OCTET_CHECK_LAUNCH();

  const int64_t column_blocks = ceil_div(kSums * cols, kWarpSize);
  OCTET_CHECK(column_blocks <= INT32_MAX, "norm backward: ", cols,
              " columns exceed the grid limit");
  column_sums_kernel<<<static_cast<unsigned>(column_blocks), dim3(kWarpSize, kColumnChunks), 0,
                       stream>>>(partials.data<float>(), tiles, kSums, cols, dgamma.data<float>(),
                                 kRms ? nullptr : dbeta.data<float>(), accumulate);
  OCTET_CHECK_LAUNCH();
  // `partials` is freed stream-ordered (cudaFreeAsync on this stream), after the kernels.
}

/// Runs f(T{}, kN) with the element type and, when the row length and every pointer allow it,
/// 16-byte packs; otherwise one element at a time.
template <typename F>
void visit_layout(DType dtype, int64_t cols, std::initializer_list<const void*> pointers, F&& f) {
  math::visit_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kN = kVectorWidth<T>;
    if (cols % kN == 0 && vector_aligned(pointers)) {
      f(t, std::integral_constant<int, kN>{});
    } else {
      f(t, std::integral_constant<int, 1>{});
    }
  });
}

template <bool kRms>
bool forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, const Tensor& y,
             const Tensor& mean, const Tensor& rstd, const FusedCast& cast) {
  DeviceGuard guard(x.device());
  bool transposed = false;
  visit_layout(x.dtype(), x.cols(),
               {x.raw_data(), y.raw_data(), gamma.raw_data(), ptr_or_null(beta), cast.data},
               [&](auto t, auto n) {
                 transposed = launch_forward<decltype(t), decltype(n)::value, kRms>(
                     x, gamma, beta, eps, y, mean, rstd, cast);
               });
  return transposed;
}

template <bool kRms>
void backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
              const Tensor& rstd, const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
              const Tensor& residual, bool accumulate) {
  DeviceGuard guard(x.device());
  visit_layout(
      x.dtype(), x.cols(),
      {dy.raw_data(), x.raw_data(), dx.raw_data(), gamma.raw_data(), ptr_or_null(residual)},
      [&](auto t, auto n) {
        launch_backward<decltype(t), decltype(n)::value, kRms>(dy, x, gamma, mean, rstd, dx, dgamma,
                                                               dbeta, residual, accumulate);
      });
}

}  // namespace

bool layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                       const Tensor& y, const Tensor& mean, const Tensor& rstd,
                       const FusedCast& cast) {
  return forward<false>(x, gamma, beta, eps, y, mean, rstd, cast);
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, const Tensor& dx, const Tensor& dgamma,
                        const Tensor& dbeta, const Tensor& residual, bool accumulate_params) {
  backward<false>(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, residual, accumulate_params);
}

bool rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, const Tensor& y,
                     const Tensor& rstd, const FusedCast& cast) {
  return forward<true>(x, gamma, Tensor(), eps, y, Tensor(), rstd, cast);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dgamma, const Tensor& residual,
                      bool accumulate_params) {
  backward<true>(dy, x, gamma, Tensor(), rstd, dx, dgamma, Tensor(), residual, accumulate_params);
}

}  // namespace octet::ops::cuda
