// CUDA kernels of the MoE scaled activation h = (act(fc1) + bias[e]) * prob between the experts'
// GEMMs (include/octet/ops/moe.h):
//   - forward, unfused: one CTA per permuted row;
//   - forward with FC2's FP8 input: per-tensor targets (delayed scaling, the training path) take
//     a kernel of their own, whose CTA computes a 128x128 tile of h in registers, stores its
//     row-wise codes directly and its column-wise codes through a byte tile in shared memory; other
//     scaling modes stage h in the tile quantizer (quantize_tile.cuh);
//   - backward: one warp per row, whose dprob is that warp's fixed-order reduction (WarpFold), and
//     one CTA per 16-row dbias tile, whose partial sums sit in their own slots until a second pass
//     adds each expert's tiles in order; rows of 16-byte packs read the next strip by cp.async
//     while computing this one.
// No float atomics (DESIGN.md rule 3): every output is the same bytes on every run.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "octet/core/cuda_context.h"
#include "ops/cuda/fused_cast.cuh"
#include "ops/cuda/launch_util.cuh"
#include "ops/cuda/mma_util.cuh"
#include "ops/cuda/quantize_tile.cuh"
#include "ops/fixed_order_reduce.h"
#include "ops/moe_backend.h"
#include "ops/moe_math.h"
#include "ops/raw_access.h"

namespace octet::ops::cuda {
namespace {

using math::from_float;
using math::to_float;

/// Threads of the unfused forward's CTA (one permuted row each).
constexpr int kRowThreads = 256;
/// Lanes of the fixed order of every row reduction (dprob).
constexpr int kLanes = kMoeDotLanes;

/// The activation's inputs at columns [j, j + kN) of one fc1 row x, as floats: the gate x[j..] and,
/// for the gated activations, up x[f + j..] (otherwise 0, which activate ignores).
template <MoeActivation kAct, int kN>
struct ActivationIn {
  float gate[kN], up[kN];

  template <typename T>
  __device__ ActivationIn(const T* x, int64_t f, int64_t j) : ActivationIn(x + j, x + f + j) {}

  /// From the gate's pack at `gate_at` and, for the gated activations, the up pack at `up_at`.
  template <typename T>
  __device__ ActivationIn(const T* gate_at, const T* up_at) {
    load_floats<kN>(gate_at, gate);
    if constexpr (moe::gated(kAct)) {
      load_floats<kN>(up_at, up);
    } else {
#pragma unroll
      for (int k = 0; k < kN; ++k) up[k] = 0.0f;
    }
  }

  /// From 16-byte packs of bf16 already loaded (gate, and up for the gated activations), unpacked
  /// by words: as a Pack of uint16_t the compiler would give each element a register first.
  __device__ ActivationIn(const uint4& g, const uint4& u) {
    static_assert(kN == kVectorWidth<uint16_t>, "a 16-byte pack of bf16");
    quant::unpack<uint16_t>(g, gate);
    if constexpr (moe::gated(kAct)) {
      quant::unpack<uint16_t>(u, up);
    } else {
#pragma unroll
      for (int k = 0; k < kN; ++k) up[k] = 0.0f;
    }
  }

  /// v = act(gate, up), plus bias[j..] when bias (the expert's row) is set: h before the row's
  /// prob.
  __device__ void value(const float* bias, int64_t j, float (&v)[kN]) const {
    float b[kN];
    if (bias != nullptr) load_floats<kN>(bias + j, b);
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      v[k] = moe::activate<kAct>(gate[k], up[k]);
      if (bias != nullptr) v[k] = rn::add(v[k], b[k]);
    }
  }
};

// ----------------------------------------------------------------------------
// CUDA kernels: forward without a cast (one CTA per permuted row)

template <typename T, MoeActivation kAct, int kN>
__global__ void scaled_activation_forward_kernel(const T* __restrict__ fc1,
                                                 const float* __restrict__ row_prob,
                                                 const int32_t* __restrict__ row_map,
                                                 const int32_t* __restrict__ offsets,
                                                 int64_t experts, const float* __restrict__ bias,
                                                 int64_t f, T* __restrict__ h) {
  const int64_t r = blockIdx.x, in_cols = moe::gated(kAct) ? 2 * f : f;
  const int32_t e = moe::expert_of_row(offsets, experts, r);
  const bool padding = row_map[2 * r] < 0 || e < 0;
  const T* x = fc1 + r * in_cols;
  const float* b = bias != nullptr && !padding ? bias + e * f : nullptr;
  const float p = row_prob[r];
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * kN; j < f; j += blockDim.x * kN) {
    if (padding) {
      store_zeros<kN>(h + r * f + j);
      continue;
    }
    float v[kN];
    ActivationIn<kAct, kN>(x, f, j).value(b, j, v);
#pragma unroll
    for (int k = 0; k < kN; ++k) v[k] = rn::mul(v[k], p);
    store_pack<kN>(h + r * f + j, round_pack<T>(v));
  }
}

// ----------------------------------------------------------------------------
// CUDA kernels: forward with FC2's FP8 input, per-tensor targets
//
// A CTA owns a 128x128 tile of one expert's h. Thread t owns the 8 columns of pack t % 16 in the
// 4-row blocks t / 16 and t / 16 + 16: it loads each block's gate and up packs at once, computes h
// as the unfused kernel does (rounded to bf16, as ops::quantize would read it), and stores the
// block's row-wise codes (8 bytes a row). Under per-tensor scaling both copies encode the same
// values with the same scale, so the column-wise codes are the row-wise ones transposed: the thread
// transposes its 4x4 byte blocks in registers and leaves them in shared memory as 4-row words of
// their columns, from which the tile's columns leave as 16-byte runs of data_t.

/// Side of the h tile of one CTA, and its threads.
constexpr int kCastTile = 128;
constexpr int kCastThreads = 256;
/// CTAs an SM must hold at once: three keep more of the SM's loads in flight than two, and their
/// 80 registers a thread still hold a block's eight packs and the gated activations' arithmetic
/// without spilling.
constexpr int kCastCtasPerSm = 3;
/// A thread's block: 4 rows of one 8-column bf16 pack.
constexpr int kBlockRows = 4, kBlockCols = 8;
constexpr int kPacksPerTileRow = kCastTile / kBlockCols;
constexpr int kBlocksPerPass = kCastThreads / kPacksPerTileRow;
constexpr int kCastPasses = kCastTile / (kBlockRows * kBlocksPerPass);
/// The transposed codes in shared memory: per tile column, kCastTile / 4 words of 4 rows each.
constexpr int kWordsPerColumn = kCastTile / kBlockRows;
/// data_t runs of 16 rows: kCastTile / 16 per column, kColumnRuns per thread.
constexpr int kRunsPerColumn = kCastTile / quant::kRunElems;
constexpr int kColumnRuns = kCastTile * kRunsPerColumn / kCastThreads;
static_assert(kCastTile % (kBlockRows * kBlocksPerPass) == 0 && kCastPasses >= 1,
              "the passes cover the tile's rows");
static_assert(kWordsPerColumn == kWarpSize && kPacksPerTileRow == 16,
              "the shared-memory swizzle below assumes 32 words a column and 16 packs a row");
static_assert(kCastTile * kRunsPerColumn % kCastThreads == 0, "whole runs a thread");

/// Physical word of logical word `word` (4-row group) of tile column `col`: XOR with twice the
/// column's pack, so that the 16 threads of a row block, which store to 16 columns of different
/// packs, hit 16 different banks, and two row blocks of one warp the other 16.
__device__ __forceinline__ int swizzled_word(int col, int word) {
  return word ^ (2 * (col / kBlockCols));
}

/// One expert's matrix of the per-tensor cast: its rows of h and its FP8 target.
struct ExpertCast {
  uint8_t* data;       ///< [rows, f] row-wise codes, or nullptr
  uint8_t* data_t;     ///< [f, rows] column-wise codes, or nullptr
  float* scale_inv;    ///< f32[1] (written by the matrix's first tile)
  float* scale_inv_t;  ///< f32[1] when data_t's scale_inv is its own tensor, else nullptr
  const float* scale;  ///< f32[1], the multiplier
  uint32_t* amax;      ///< raised to max |h| after every store, or nullptr
  const float* bias;   ///< the expert's bias row [f], or nullptr
  int64_t row0, rows;  ///< its first permuted row and its row count (a multiple of 16)
};

/// Experts per launch; the launch is about 2.5 KB of parameters.
constexpr int kMaxCastGroup = 32;

/// One launch of the per-tensor cast: up to kMaxCastGroup experts, expert m owning the CTAs
/// [first_tile[m], first_tile[m + 1]), one per 128x128 tile of its rows of h.
struct CastGroup {
  ExpertCast experts[kMaxCastGroup];
  int64_t first_tile[kMaxCastGroup + 1];
  int count;
  int64_t col_tiles;       ///< tiles across f
  const uint16_t* fc1;     ///< bf16 [capacity, in_cols]
  const float* row_prob;   ///< [capacity]
  const int32_t* row_map;  ///< [capacity, 2]
  uint16_t* h;             ///< optional: bf16 [capacity, f]
  int64_t f;
};

static_assert(sizeof(CastGroup) <= quant::kPortableParamBytes,
              "a CastGroup exceeds 4 KB of kernel parameters: lower kMaxCastGroup");

/// The 4x4 byte transpose: word i of `rows` holds row i's 4 codes; word j of the result holds
/// column j's 4 codes, row 0 in the low byte.
__device__ __forceinline__ void transpose_4x4(const uint32_t (&rows)[4], uint32_t (&cols)[4]) {
  const uint32_t lo01 = __byte_perm(rows[0], rows[1], 0x5140);  // r0c0 r1c0 r0c1 r1c1
  const uint32_t hi01 = __byte_perm(rows[0], rows[1], 0x7362);  // r0c2 r1c2 r0c3 r1c3
  const uint32_t lo23 = __byte_perm(rows[2], rows[3], 0x5140);
  const uint32_t hi23 = __byte_perm(rows[2], rows[3], 0x7362);
  cols[0] = __byte_perm(lo01, lo23, 0x5410);
  cols[1] = __byte_perm(lo01, lo23, 0x7632);
  cols[2] = __byte_perm(hi01, hi23, 0x5410);
  cols[3] = __byte_perm(hi01, hi23, 0x7632);
}

template <MoeActivation kAct, DType kFp8>
__global__ void __launch_bounds__(kCastThreads, kCastCtasPerSm)
    scaled_activation_cast_kernel(const __grid_constant__ CastGroup g) {
  using T = uint16_t;  // bf16 bits
  constexpr bool kGated = moe::gated(kAct);
  __shared__ __align__(16) uint32_t codes_t[kCastTile * kWordsPerColumn];
  __shared__ uint32_t scratch[kCastThreads / kWarpSize];
  const int m =
      static_cast<int>(last_start_at_most(g.first_tile, g.count, static_cast<int64_t>(blockIdx.x)));
  const ExpertCast& x = g.experts[m];
  const int64_t tile = blockIdx.x - g.first_tile[m];
  const int64_t ti = tile / g.col_tiles, tj = tile % g.col_tiles;
  const int64_t f = g.f, in_cols = kGated ? 2 * f : f;
  const int t = static_cast<int>(threadIdx.x);
  const int pack = t % kPacksPerTileRow;
  const int64_t col = tj * kCastTile + pack * kBlockCols;  // this thread's first column
  const bool col_in = col < f;  // f is a multiple of the pack: a block is wholly in or out
  const float multiplier = *x.scale;
  uint32_t amax_pair = 0;  // max |h| bits of the even and odd columns, as bf16 halves

#pragma unroll
  for (int pass = 0; pass < kCastPasses; ++pass) {
    const int block = t / kPacksPerTileRow + pass * kBlocksPerPass;
    const int64_t r = ti * kCastTile + block * kBlockRows;  // the block's first row in the matrix
    uint4 gate[kBlockRows], up[kBlockRows];                 // bf16 packs
    int32_t token[kBlockRows];
    float prob[kBlockRows];
    // Every load of the block at once; padding rows of the group are read too (the FC1 GEMM wrote
    // them) and give zeros below.
    const int64_t row0 = x.row0 + r;  // the block's first permuted row
    const T* in = g.fc1 + row0 * in_cols + col;
#pragma unroll
    for (int k = 0; k < kBlockRows; ++k, in += in_cols) {
      token[k] = g.row_map[2 * (row0 + k)];
      prob[k] = g.row_prob[row0 + k];
      if (col_in) {
        gate[k] = *reinterpret_cast<const uint4*>(in);
        if constexpr (kGated) up[k] = *reinterpret_cast<const uint4*>(in + f);
      }
    }
    uint32_t codes[2][kBlockRows];  // [column half][row]: 4 codes each
#pragma unroll
    for (int k = 0; k < kBlockRows; ++k) {
      float v[kBlockCols] = {};
      if (col_in && token[k] >= 0) {
        ActivationIn<kAct, kBlockCols>(gate[k], up[k]).value(x.bias, col, v);
#pragma unroll
        for (int c = 0; c < kBlockCols; ++c) v[c] = rn::mul(v[c], prob[k]);
      }
      const Pack<T, kBlockCols> hb = round_pack<T>(v);
      uint32_t words[kBlockCols / 2];
      memcpy(words, &hb, sizeof(words));
      if (g.h != nullptr && col_in)
        *reinterpret_cast<uint4*>(g.h + (row0 + k) * f + col) =
            make_uint4(words[0], words[1], words[2], words[3]);
#pragma unroll
      for (int w = 0; w < kBlockCols / 2; ++w)
        amax_pair = quant::bf16x2_abs_max(amax_pair, words[w]);
        // The codes of the rounded values, one multiply each (quant::quantize_run's arithmetic).
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t a = words[2 * half], b = words[2 * half + 1];
        const uint32_t lo = quant::encode_fp8x2<kFp8>(
            __uint_as_float(a << 16) * multiplier, __uint_as_float(a & 0xFFFF0000u) * multiplier);
        const uint32_t hi = quant::encode_fp8x2<kFp8>(
            __uint_as_float(b << 16) * multiplier, __uint_as_float(b & 0xFFFF0000u) * multiplier);
        codes[half][k] = lo | hi << 16;
      }
      if (x.data != nullptr && col_in)
        *reinterpret_cast<uint2*>(x.data + (r + k) * f + col) =
            make_uint2(codes[0][k], codes[1][k]);
    }
    if (x.data_t != nullptr) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t columns[4];
        transpose_4x4(codes[half], columns);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = pack * kBlockCols + half * 4 + j;  // the tile column
          codes_t[c * kWordsPerColumn + swizzled_word(c, block)] = columns[j];
        }
      }
    }
  }

  if (x.data_t != nullptr) {  // uniform over the CTA
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kColumnRuns; ++i) {
      const int u = t + i * kCastThreads;
      const int c = u / kRunsPerColumn, run = u % kRunsPerColumn;
      const int64_t gcol = tj * kCastTile + c;
      if (gcol >= f) continue;
      // Logical words 4 run .. 4 run + 3 sit at the swizzled 4-word group, with word pairs
      // swapped when the XOR flips bit 1.
      const int phys = swizzled_word(c, 4 * run);
      uint4 v = *reinterpret_cast<const uint4*>(&codes_t[c * kWordsPerColumn + (phys & ~3)]);
      if (phys & 2) v = make_uint4(v.z, v.w, v.x, v.y);
      *reinterpret_cast<uint4*>(x.data_t + gcol * x.rows + ti * kCastTile +
                                run * quant::kRunElems) = v;
    }
  }
  if (tile == 0 && t == 0) {
    *x.scale_inv = fp8::scale_inv_of(multiplier);
    if (x.scale_inv_t != nullptr) *x.scale_inv_t = fp8::scale_inv_of(multiplier);
  }
  if (x.amax != nullptr) {  // uniform over the CTA
    const uint32_t bits = max(amax_pair << 16, amax_pair & 0xFFFF0000u);
    quant::publish_amax<kCastThreads>(bits, x.amax, scratch);
  }
}

// ----------------------------------------------------------------------------
// CUDA kernels: forward with FC2's FP8 input, any scaling mode (the tile quantizer's Source)

/// The tile quantizer's Source for one expert's rows of the scaled activation (FC2's fused FP8
/// input): the matrix is h's rows [row0, row0 + p.rows) of expert e, each cell computed as
/// scaled_activation_forward_kernel computes it and rounded to T, so the FP8 bytes and the amax
/// are those of ops::quantize on that kernel's h. Also stores h when `h` is set.
template <typename T, MoeActivation kAct>
struct ScaledActivationTile {
  const T* fc1;            ///< [capacity, in_cols]
  const float* row_prob;   ///< [capacity]
  const int32_t* row_map;  ///< [capacity, 2]
  const float* bias;       ///< the expert's bias row [f], or nullptr
  T* h;                    ///< optional: [capacity, f]
  int64_t f, row0;
  bool vec;  ///< fc1, h and bias 16-byte aligned, f a multiple of a 16-byte pack

  using L = quant::TileLayout<T>;
  static constexpr int kE = L::kChunkElems;
  static constexpr bool kGated = moe::gated(kAct);
  /// Chunks each thread stages, as in quant::load_tile.
  static constexpr int kChunks = quant::kTile * L::kChunksPerRow / quant::kTileThreads;
  static_assert(quant::kTile * L::kChunksPerRow % quant::kTileThreads == 0, "whole chunks");

  __device__ void stage(const quant::TileParams& p, T* tile, int64_t r0, int64_t c0) const {
    const int64_t in_cols = kGated ? 2 * f : f;
#pragma unroll 4
    for (int i = 0; i < kChunks; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * quant::kTileThreads;
      const int r = idx / L::kChunksPerRow, j = idx % L::kChunksPerRow;
      const int64_t gr = r0 + r, gc = c0 + static_cast<int64_t>(j) * kE;
      Pack<T, kE> o;
      const int64_t row = row0 + gr;  // the permuted row
      // Padding rows of the group are zeros, as the unfused kernel writes them.
      const bool live = gr < p.rows && row_map[2 * row] >= 0;
      T* h_row = h != nullptr && gr < p.rows ? h + row * f : nullptr;
      if (live && vec && gc + kE <= p.cols) {
        const float prob = row_prob[row];
        float v[kE];
        ActivationIn<kAct, kE>(fc1 + row * in_cols, f, gc).value(bias, gc, v);
#pragma unroll
        for (int k = 0; k < kE; ++k) v[k] = rn::mul(v[k], prob);
        o = round_pack<T>(v);
        if (h_row != nullptr) store_pack<kE>(h_row + gc, o);
      } else {
        const float prob = live ? row_prob[row] : 0.0f;
#pragma unroll
        for (int k = 0; k < kE; ++k) {
          const bool inside = gr < p.rows && gc + k < p.cols;
          float v[1] = {0.0f};
          if (live && inside) {
            ActivationIn<kAct, 1>(fc1 + row * in_cols, f, gc + k).value(bias, gc + k, v);
            v[0] = rn::mul(v[0], prob);
          }
          o.v[k] = from_float<T>(v[0]);
          if (inside && h_row != nullptr) h_row[gc + k] = o.v[k];
        }
      }
      store_pack<kE>(tile + L::chunk_offset(r, j), o);
    }
    __syncthreads();
  }
};

// ----------------------------------------------------------------------------
// CUDA kernels: backward

/// Rows of one backward CTA, one warp each: a dbias tile, so the tile's column sums come from the
/// dh already loaded, with no second pass over dh.
constexpr int kBackwardRows = static_cast<int>(kMoeBiasTileRows);
constexpr int kBackwardThreads = kBackwardRows * kWarpSize;
/// CTAs per SM that the backward's register budget must allow (64 registers a thread).
constexpr int kBackwardCtasPerSm = 2;

/// The inputs a lane reads for one pack of the backward: dh, the gate and, gated, the up half.
template <MoeActivation kAct>
inline constexpr int kBackwardInputs = moe::gated(kAct) ? 3 : 2;

/// Strips whose reads the backward stages in shared memory, for rows of 16-byte packs: the strip
/// being computed and the next one in flight (three or four measured slower; PERFORMANCE.md).
constexpr int kBackwardStages = 2;

/// Dynamic shared memory of the backward with `stages` strips of 16-byte packs staged.
template <MoeActivation kAct>
constexpr size_t backward_stage_bytes(int stages) {
  return static_cast<size_t>(stages) * kBackwardInputs<kAct> * kBackwardThreads * kVectorBytes;
}

/// CTA b owns rows [16 b, 16 b + 16), warp w row 16 b + w: dfc1 and d_row_prob of that row (its
/// fixed-order reduction over the row's F columns, WarpFold) from one pass over the row in
/// strips, and, when dbias_partial is set, the tile's dbias partial: sum over the tile's mapped
/// rows, in row order, of dh * prob, each strip's terms crossing through shared memory.
///
/// kStages > 0 (16-byte packs only): each lane copies its packs of the next kStages strips into
/// its own slots of shared memory (cp.async), and refills a strip's slots once it has computed it
/// (its stores used every value read from them), so kStages - 1 strips of reads stay in flight
/// through each strip's arithmetic, stores and barriers without holding registers (prefetching
/// into registers spilled under the 64-register cap). A lane reads only the slots it filled, so
/// its own cp.async wait orders them. kStages = 0 loads straight into registers. Both read the
/// same values, so the same bits.
template <typename T, MoeActivation kAct, int kN, int kStages>
__global__ void __launch_bounds__(kBackwardThreads, kBackwardCtasPerSm)
    scaled_activation_backward_kernel(const T* __restrict__ dh, const T* __restrict__ fc1,
                                      const float* __restrict__ row_prob,
                                      const int32_t* __restrict__ row_map,
                                      const int32_t* __restrict__ offsets, int64_t experts,
                                      const float* __restrict__ bias, int64_t rows, int64_t f,
                                      T* __restrict__ dfc1, float* __restrict__ d_row_prob,
                                      float* __restrict__ dbias_partial) {
  using Fold = WarpFold<kLanes, kN, SumOp>;
  constexpr int kStrip = Fold::kStrip;
  constexpr bool kGated = moe::gated(kAct);
  constexpr int kInputs = kBackwardInputs<kAct>;
  static_assert(kStages == 0 || kN * sizeof(T) == kVectorBytes, "cp.async stages 16-byte packs");
  __shared__ __align__(kVectorBytes) float strip_terms[kBackwardRows][kStrip];
  __shared__ bool mapped_rows[kBackwardRows];
  extern __shared__ uint4 staged[];  // [kStages][kInputs][kBackwardThreads] when kStages > 0
  const int w = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t in_cols = kGated ? 2 * f : f;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kBackwardRows + w;
  const bool inside = r < rows;
  // Mapped rows hold a routed token (dbias counts them); live rows also lie in an expert group.
  const bool mapped = inside && row_map[2 * r] >= 0;
  const int32_t e = inside ? moe::expert_of_row(offsets, experts, r) : -1;
  const bool live = mapped && e >= 0;
  const bool with_dbias = dbias_partial != nullptr;      // uniform across the CTA
  if (with_dbias && lane == 0) mapped_rows[w] = mapped;  // read after the first barrier
  const T* x = fc1 + r * in_cols;
  T* d = dfc1 + r * in_cols;
  const float* b = bias != nullptr && live ? bias + e * f : nullptr;
  const float p = mapped ? row_prob[r] : 0.0f;
  const int64_t strips = ceil_div(f, static_cast<int64_t>(kStrip));
  // This lane's slot of input i for strip q.
  const auto slot = [&](int64_t q, int i) {
    return reinterpret_cast<T*>(
        &staged[((q % (kStages > 0 ? kStages : 1)) * kInputs + i) * kBackwardThreads +
                threadIdx.x]);
  };
  // Starts this lane's copies of strip q (none past the row or for unmapped rows), as one group.
  const auto stage = [&](int64_t q) {
    const int64_t j = q * kStrip + static_cast<int64_t>(lane) * kN;
    if (q < strips && inside && j < f && mapped) {
      cp_async_16(slot(q, 0), dh + r * f + j);
      if (live) {
        cp_async_16(slot(q, 1), x + j);
        if constexpr (kGated) cp_async_16(slot(q, 2), x + f + j);
      }
    }
    cp_async_commit();
  };
  if constexpr (kStages > 0) {
#pragma unroll
    for (int q = 0; q < kStages; ++q) stage(q);
  }
  Fold fold;
  for (int64_t q = 0; q < strips; ++q) {  // the same strips in every warp
    const int64_t j = q * kStrip + static_cast<int64_t>(lane) * kN;
    const bool in_row = inside && j < f;
    const T* dh_at = dh + r * f + j;
    const T* gate_at = x + j;
    const T* up_at = x + f + j;
    if constexpr (kStages > 0) {
      cp_async_wait<kStages - 1>();  // strip q's group has landed
      dh_at = slot(q, 0);
      gate_at = slot(q, 1);
      up_at = slot(q, kInputs - 1);
    }
    if (in_row && mapped) {
      float g[kN];
      load_floats<kN>(dh_at, g);
      if (with_dbias) {  // this row's dbias terms of the strip
        Pack<float, kN> terms;
#pragma unroll
        for (int k = 0; k < kN; ++k) terms.v[k] = rn::mul(g[k], p);
        store_pack<kN>(&strip_terms[w][lane * kN], terms);
      }
      if (live) {
        const ActivationIn<kAct, kN> a(gate_at, up_at);
        float v[kN];  // the dprob terms first: fewer values live at once
        a.value(b, j, v);
#pragma unroll
        for (int k = 0; k < kN; ++k) v[k] = rn::mul(g[k], v[k]);
        fold.add(q, v);
        float dgate[kN], dup[kN];
#pragma unroll
        for (int k = 0; k < kN; ++k) {
          dgate[k] = dup[k] = 0.0f;
          moe::activate_grad<kAct>(rn::mul(g[k], p), a.gate[k], a.up[k], dgate[k], dup[k]);
        }
        store_pack<kN>(d + j, round_pack<T>(dgate));
        if constexpr (kGated) store_pack<kN>(d + f + j, round_pack<T>(dup));
      }
    }
    if (in_row && !live) {
      store_zeros<kN>(d + j);
      if constexpr (kGated) store_zeros<kN>(d + f + j);
    }
    // Strip q's slots are read (their values went into the stores above): refill them.
    if constexpr (kStages > 0) stage(q + kStages);
    if (!with_dbias) continue;
    // The strip's column sums over the tile's mapped rows, in row order.
    __syncthreads();
    const int64_t tile = blockIdx.x;
    for (int c = static_cast<int>(threadIdx.x); c < kStrip; c += kBackwardThreads) {
      const int64_t col = q * kStrip + c;
      if (col >= f || (tile + 1) * kBackwardRows > rows) continue;
      float acc = 0.0f;
#pragma unroll
      for (int row = 0; row < kBackwardRows; ++row)
        if (mapped_rows[row]) acc = rn::add(acc, strip_terms[row][c]);
      dbias_partial[tile * f + col] = acc;
    }
    __syncthreads();  // the next strip rewrites strip_terms
  }
  if constexpr (kStages > 0) cp_async_wait<0>();  // no copy outlives the CTA's shared memory
  const float dot = fold.reduce();
  if (inside && lane == 0) d_row_prob[r] = live ? dot : 0.0f;
}

/// Pass 2: dbias[e, j] = sum of e's tiles' partials in tile order.
__global__ void dbias_expert_sum_kernel(const float* partial, const int32_t* offsets, int64_t f,
                                        float* dbias) {
  const int64_t e = blockIdx.x;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= f) return;
  float acc = 0.0f;
  for (int64_t tile = offsets[e] / kMoeBiasTileRows; tile < offsets[e + 1] / kMoeBiasTileRows;
       ++tile)
    acc = rn::add(acc, partial[tile * f + j]);
  dbias[e * f + j] = acc;
}

// ----------------------------------------------------------------------------
// kernel launchers

/// The per-tensor cast's launches for `casts`, or false when some expert or tensor needs the tile
/// quantizer instead: another scaling mode, f32 activations, a row count that is not a multiple of
/// the 128-row tile (the kernel stores whole tiles: plans align every group to it), or a pointer or
/// width that defeats the kernel's vector accesses.
bool launch_per_tensor_cast(MoeActivation act, const Tensor& fc1, const Tensor& row_prob,
                            const MoePlan& plan, const Tensor& bias, const Tensor& h, int64_t f,
                            const MoeExpertCasts& casts) {
  if (fc1.dtype() != DType::bf16 || f % kBlockCols != 0 ||
      !vector_aligned(
          {fc1.raw_data(), quant::data_or_null<void>(h), quant::data_or_null<void>(bias)}))
    return false;
  std::vector<int> used;  // experts with rows, all of one FP8 dtype (a launch's)
  DType fp8 = DType::e4m3;
  for (size_t e = 0; e < casts.experts.size(); ++e) {
    const int64_t rows = casts.offsets[e + 1] - casts.offsets[e];
    if (rows == 0) continue;
    const fp8::QuantizedTensor& q = *casts.experts[e].out;
    if (used.empty()) fp8 = q.dtype;
    if (q.mode != fp8::ScalingMode::per_tensor || q.dtype != fp8 || rows % kCastTile != 0 ||
        !casts.experts[e].args.scale.defined() ||
        !vector_aligned({quant::data_or_null<void>(q.data), quant::data_or_null<void>(q.data_t)}))
      return false;
    used.push_back(static_cast<int>(e));
  }
  if (used.empty()) return true;  // no expert has rows: nothing to write
  const cudaStream_t stream = octet::cuda::stream(fc1.device());
  for (size_t begin = 0; begin < used.size(); begin += kMaxCastGroup) {
    CastGroup group{};
    group.col_tiles = ceil_div(f, static_cast<int64_t>(kCastTile));
    group.fc1 = in<uint16_t>(fc1);
    group.row_prob = in<float>(row_prob);
    group.row_map = in<int32_t>(plan.row_map);
    group.h = quant::data_or_null<uint16_t>(h);
    group.f = f;
    for (size_t i = begin; i < used.size() && group.count < kMaxCastGroup; ++i) {
      const int e = used[i];
      ExpertCast& x = group.experts[group.count];
      x.row0 = casts.offsets[e];
      x.rows = casts.offsets[e + 1] - casts.offsets[e];
      // The target's pointers as the tile quantizer takes them (scale_inv_t null when shared).
      const quant::TileParams p =
          quant::tile_params(x.rows, f, *casts.experts[e].out, casts.experts[e].args);
      x.data = p.data;
      x.data_t = p.data_t;
      x.scale_inv = static_cast<float*>(p.scale_inv != nullptr ? p.scale_inv : p.scale_inv_t);
      x.scale_inv_t = p.scale_inv != nullptr ? static_cast<float*>(p.scale_inv_t) : nullptr;
      x.scale = p.scale;
      x.amax = p.amax;
      x.bias = bias.defined() ? in<float>(bias) + static_cast<int64_t>(e) * f : nullptr;
      group.first_tile[group.count + 1] =
          group.first_tile[group.count] +
          ceil_div(x.rows, static_cast<int64_t>(kCastTile)) * group.col_tiles;
      ++group.count;
    }
    const int64_t tiles = group.first_tile[group.count];
    OCTET_CHECK(tiles <= INT_MAX, "moe_scaled_activation_forward: ", tiles,
                " tiles of FC2's FP8 input in one launch; expected at most ", INT_MAX);
    moe::visit_activation(act, [&](auto a) {
      visit_fp8(fp8, [&](auto fp8_tag) {
        scaled_activation_cast_kernel<decltype(a)::value, decltype(fp8_tag)::value>
            <<<static_cast<unsigned>(tiles), kCastThreads, 0, stream>>>(group);
        OCTET_CHECK_LAUNCH();
      });
    });
  }
  return true;
}

}  // namespace

void moe_scaled_activation_forward(MoeActivation act, const Tensor& fc1, const Tensor& row_prob,
                                   const MoePlan& plan, const Tensor& bias, const Tensor& h) {
  const cudaStream_t stream = octet::cuda::stream(fc1.device());
  math::visit_dtype(fc1.dtype(), [&](auto type) {
    using T = decltype(type);
    const float* b = quant::data_or_null<const float>(bias);
    moe::visit_activation(act, [&](auto a) {
      visit_pack<T>(h.cols(), {fc1.raw_data(), h.raw_data(), b}, [&](auto pack) {
        scaled_activation_forward_kernel<T, decltype(a)::value, decltype(pack)::value>
            <<<static_cast<unsigned>(h.rows()), kRowThreads, 0, stream>>>(
                in<T>(fc1), in<float>(row_prob), in<int32_t>(plan.row_map),
                in<int32_t>(plan.offsets), plan.experts(), b, h.cols(), out<T>(h));
        OCTET_CHECK_LAUNCH();
      });
    });
  });
}

void moe_scaled_activation_forward_cast(MoeActivation act, const Tensor& fc1,
                                        const Tensor& row_prob, const MoePlan& plan,
                                        const Tensor& bias, const Tensor& h,
                                        const MoeExpertCasts& casts) {
  const int64_t f = moe::gated(act) ? fc1.cols() / 2 : fc1.cols();
  const int64_t grouped = casts.offsets.back();
  if (h.defined() && h.rows() > grouped) h.slice(grouped, h.rows()).zero();
  if (launch_per_tensor_cast(act, fc1, row_prob, plan, bias, h, f, casts)) return;
  math::visit_dtype(fc1.dtype(), [&](auto type) {
    using T = decltype(type);
    moe::visit_activation(act, [&](auto a) {
      using Source = ScaledActivationTile<T, decltype(a)::value>;
      std::vector<quant::TileMatrix<Source>> matrices;
      for (size_t e = 0; e < casts.experts.size(); ++e) {
        const int64_t rows = casts.offsets[e + 1] - casts.offsets[e];
        if (rows == 0) continue;
        Source source{};
        source.fc1 = in<T>(fc1);
        source.row_prob = in<float>(row_prob);
        source.row_map = in<int32_t>(plan.row_map);
        source.bias = bias.defined() ? in<float>(bias) + static_cast<int64_t>(e) * f : nullptr;
        source.h = h.defined() ? out<T>(h) : nullptr;
        source.f = f;
        source.row0 = casts.offsets[e];
        source.vec = f % Source::kE == 0 && vector_aligned({source.fc1, source.h, source.bias});
        const FusedQuantize& target = casts.experts[e];
        matrices.push_back({rows, f, target.out, &target.args, source});
      }
      quant::quantize_tile_group<T, Source>(matrices, fc1.device());
    });
  });
}

void moe_scaled_activation_backward(MoeActivation act, const Tensor& dh, const Tensor& fc1,
                                    const Tensor& row_prob, const MoePlan& plan, const Tensor& bias,
                                    const Tensor& dfc1, const Tensor& d_row_prob,
                                    const Tensor& dbias) {
  const cudaStream_t stream = octet::cuda::stream(fc1.device());
  const int64_t rows = dh.rows(), f = dh.cols();
  // dbias: the backward kernel writes each tile's partial, a second kernel sums each expert's
  // tiles in order.
  const int64_t tiles = rows / kMoeBiasTileRows;
  const Tensor partial =
      dbias.defined() ? Tensor::empty({tiles, f}, DType::f32, fc1.device()) : Tensor();
  math::visit_dtype(fc1.dtype(), [&](auto type) {
    using T = decltype(type);
    const float* b = quant::data_or_null<const float>(bias);
    moe::visit_activation(act, [&](auto a) {
      constexpr MoeActivation kAct = decltype(a)::value;
      visit_pack<T>(f, {dh.raw_data(), fc1.raw_data(), dfc1.raw_data(), b}, [&](auto pack) {
        constexpr int kN = decltype(pack)::value;
        constexpr int kStages = kN * sizeof(T) == kVectorBytes ? kBackwardStages : 0;
        const auto kernel = scaled_activation_backward_kernel<T, kAct, kN, kStages>;
        constexpr size_t kShared = backward_stage_bytes<kAct>(kStages);
        if constexpr (kShared > 0) {
          static octet::cuda::PerDeviceFlag opted_in;  // one per kernel
          opt_in_shared_memory(kernel, kShared, fc1.device(), opted_in);
        }
        kernel<<<static_cast<unsigned>(ceil_div(rows, kBackwardRows)), kBackwardThreads, kShared,
                 stream>>>(in<T>(dh), in<T>(fc1), in<float>(row_prob), in<int32_t>(plan.row_map),
                           in<int32_t>(plan.offsets), plan.experts(), b, rows, f, out<T>(dfc1),
                           out<float>(d_row_prob), quant::data_or_null<float>(partial));
        OCTET_CHECK_LAUNCH();
      });
    });
  });
  if (!dbias.defined()) return;
  const auto column_blocks = static_cast<unsigned>(ceil_div(f, kThreadsPerBlock));
  dbias_expert_sum_kernel<<<dim3(static_cast<unsigned>(plan.experts()), column_blocks),
                            kThreadsPerBlock, 0, stream>>>(
      in<float>(partial), in<int32_t>(plan.offsets), f, out<float>(dbias));
  OCTET_CHECK_LAUNCH();
}

}  // namespace octet::ops::cuda
