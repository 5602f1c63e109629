// CUDA kernels of the router's GEMM (router_logits and its backward). The router has few experts
// (16 in the presets) against a model width of thousands, so its three products are skinny: each
// reads the activations once in their own dtype, keeps the experts' side in registers or shared
// memory, and runs every output as one fma chain in the order include/octet/ops/moe.h states
// (the CPU reference's), so both backends give the same bits and no sum is split.
//   forward:  a CTA stages 64 tokens x 64 columns of x as floats, and the 16 experts' weights
//             for those columns; warp w takes 4 experts, lane l tokens l and l + 32; the chain
//             runs over the columns in order.
//   dx:       a thread owns 2 columns and holds the 16 experts' weights for them in registers,
//             walking 128 tokens whose dlogits sit in shared memory.
//   dweight:  a thread owns 2 columns x 16 experts of one 256-token tile's partial sums; a second
//             kernel adds each weight's tiles in order.
#include <cuda_runtime.h>

#include <cstdint>

#include "octet/core/cuda_context.h"
#include "ops/cuda/fused_cast.cuh"
#include "ops/cuda/launch_util.cuh"
#include "ops/moe_backend.h"
#include "ops/moe_math.h"
#include "ops/raw_access.h"

namespace octet::ops::cuda {
namespace {

using math::from_float;
using math::to_float;

/// Experts one CTA of the forward and dweight kernels takes (gridDim.y / .z cover the rest), and
/// the most the dx kernel keeps in registers.
constexpr int kExpertTile = 16;

// ----------------------------------------------------------------------------
// forward: logits = x weight^T

constexpr int kFwdTokens = 64;
constexpr int kFwdChunk = 64;  ///< columns of x per staged chunk
/// Floats per staged row: rows 4 banks apart, so the float4 reads of 8 consecutive lanes (8
/// consecutive rows) cover the 32 banks once.
constexpr int kFwdPitch = kFwdChunk + 4;
constexpr int kFwdExpertsPerWarp = 4;
constexpr int kFwdWarps = kExpertTile / kFwdExpertsPerWarp;
constexpr int kFwdThreads = kFwdWarps * kWarpSize;
/// CTAs an SM must hold (at most 128 registers a thread): 16 warps to hide the staging's loads.
constexpr int kFwdCtasPerSm = 4;
static_assert(kFwdTokens == 2 * kWarpSize, "a lane takes tokens lane and lane + 32");

/// One thread's share of a staged chunk: kN-element packs of x (kN = 1: element by element) and
/// kWVec-float packs of the CTA's kExpertTile weight rows, loaded one chunk ahead of their use.
template <typename T, int kN, int kWVec>
struct FwdChunk {
  static constexpr int kPerRow = kFwdChunk / kN;
  static constexpr int kLoads = kFwdTokens * kPerRow / kFwdThreads;
  static constexpr int kWPerRow = kFwdChunk / kWVec;
  static constexpr int kWLoads = kExpertTile * kWPerRow / kFwdThreads;
  static_assert(kFwdTokens * kPerRow % kFwdThreads == 0 &&
                    kExpertTile * kWPerRow % kFwdThreads == 0,
                "whole packs per thread");
  Pack<T, kN> v[kLoads];
  Pack<float, kWVec> w[kWLoads];

  /// Columns [c0, c0 + kFwdChunk) of the CTA's tokens from t0 and experts from e0; zeros outside.
  __device__ void load(const T* x, const float* weight, int64_t tokens, int64_t dim,
                       int64_t experts, int64_t t0, int64_t e0, int64_t c0) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * kFwdThreads;
      const int64_t t = t0 + idx / kPerRow, c = c0 + (idx % kPerRow) * kN;
      // kN divides dim (visit_pack): a pack that starts inside a row ends inside it.
      v[i] = t < tokens && c < dim ? load_pack<kN>(x + t * dim + c) : Pack<T, kN>{};
    }
#pragma unroll
    for (int i = 0; i < kWLoads; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * kFwdThreads;
      const int64_t e = e0 + idx / kWPerRow, c = c0 + (idx % kWPerRow) * kWVec;
      w[i] = e < experts && c < dim ? load_pack<kWVec>(weight + e * dim + c) : Pack<float, kWVec>{};
    }
  }

  /// x as floats into stage [kFwdTokens][kFwdPitch], the weights into w_stage
  /// [kExpertTile][kFwdChunk].
  __device__ void store(float* stage, float* w_stage) const {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * kFwdThreads;
      float* dst = stage + (idx / kPerRow) * kFwdPitch + (idx % kPerRow) * kN;
      if constexpr (kN % 4 == 0) {  // float4 stores (the pitch keeps rows 16-byte aligned)
#pragma unroll
        for (int k = 0; k < kN; k += 4) {
          const Pack<float, 4> f{{to_float(v[i].v[k]), to_float(v[i].v[k + 1]),
                                  to_float(v[i].v[k + 2]), to_float(v[i].v[k + 3])}};
          store_pack<4>(dst + k, f);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kN; ++k) dst[k] = to_float(v[i].v[k]);
      }
    }
#pragma unroll
    for (int i = 0; i < kWLoads; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * kFwdThreads;
      store_pack<kWVec>(w_stage + (idx / kWPerRow) * kFwdChunk + (idx % kWPerRow) * kWVec, w[i]);
    }
  }
};

/// kWVec: 4 when every weight row may be read in float4s (dim % 4 == 0, aligned), else 1. Both
/// operands go through shared memory: each weight line would otherwise miss L1 once per warp.
template <typename T, int kN, int kWVec>
__global__ void __launch_bounds__(kFwdThreads, kFwdCtasPerSm)
    router_logits_kernel(const T* __restrict__ x, const float* __restrict__ weight, int64_t tokens,
                         int64_t dim, int64_t experts, float* __restrict__ logits) {
  __shared__ __align__(16) float stage[kFwdTokens * kFwdPitch];
  __shared__ __align__(16) float w_stage[kExpertTile * kFwdChunk];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kFwdTokens;
  const int64_t cta_e0 = static_cast<int64_t>(blockIdx.y) * kExpertTile;
  const int64_t e0 = cta_e0 + warp * kFwdExpertsPerWarp;  // the warp's experts
  float acc[2][kFwdExpertsPerWarp] = {};
  FwdChunk<T, kN, kWVec> chunk;
  chunk.load(x, weight, tokens, dim, experts, t0, cta_e0, 0);
  for (int64_t c0 = 0; c0 < dim; c0 += kFwdChunk) {
    chunk.store(stage, w_stage);
    __syncthreads();
    if (c0 + kFwdChunk < dim)  // in flight while this chunk is computed
      chunk.load(x, weight, tokens, dim, experts, t0, cta_e0, c0 + kFwdChunk);
    const int valid = static_cast<int>(dim - c0 < kFwdChunk ? dim - c0 : kFwdChunk);
    const float* row0 = stage + lane * kFwdPitch;
    const float* row1 = stage + (lane + kWarpSize) * kFwdPitch;
    const float* w_rows = w_stage + warp * kFwdExpertsPerWarp * kFwdChunk;
#pragma unroll 1
    for (int k = 0; k < valid; k += kWVec) {  // kWVec divides valid: it divides dim and kFwdChunk
      const Pack<float, kWVec> a = load_pack<kWVec>(row0 + k), b = load_pack<kWVec>(row1 + k);
#pragma unroll
      for (int q = 0; q < kFwdExpertsPerWarp; ++q) {
        const Pack<float, kWVec> wq = load_pack<kWVec>(w_rows + q * kFwdChunk + k);  // broadcast
#pragma unroll
        for (int j = 0; j < kWVec; ++j) {
          acc[0][q] = rn::fma(a.v[j], wq.v[j], acc[0][q]);
          acc[1][q] = rn::fma(b.v[j], wq.v[j], acc[1][q]);
        }
      }
    }
    __syncthreads();  // the next chunk rewrites both stages
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int64_t t = t0 + lane + s * kWarpSize;
    if (t >= tokens) continue;
#pragma unroll
    for (int q = 0; q < kFwdExpertsPerWarp; ++q)
      if (e0 + q < experts) logits[t * experts + e0 + q] = acc[s][q];
  }
}

// ----------------------------------------------------------------------------
// dx += dlogits weight

constexpr int kDxThreads = 256;
constexpr int kDxTokens = 128;
constexpr int kDxUnroll = 8;  ///< tokens whose dx loads are in flight together
static_assert(kDxTokens % kDxUnroll == 0);

/// experts <= kExpertTile: the weights of the thread's kN columns stay in registers.
template <typename T, int kN>
__global__ void __launch_bounds__(kDxThreads)
    router_dx_kernel(const float* __restrict__ dlogits, const float* __restrict__ weight,
                     int64_t tokens, int64_t dim, int64_t experts, T* __restrict__ dx) {
  __shared__ __align__(16) float dl[kDxTokens][kExpertTile];
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kDxTokens;
  for (int i = static_cast<int>(threadIdx.x); i < kDxTokens * kExpertTile; i += kDxThreads) {
    const int64_t t = t0 + i / kExpertTile, e = i % kExpertTile;
    dl[i / kExpertTile][e] = t < tokens && e < experts ? dlogits[t * experts + e] : 0.0f;
  }
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kDxThreads + threadIdx.x) * kN;
  const bool inside = c < dim;
  float w[kExpertTile][kN];
#pragma unroll
  for (int e = 0; e < kExpertTile; ++e) {
    const Pack<float, kN> p =
        inside && e < experts ? load_pack<kN>(weight + e * dim + c) : Pack<float, kN>{};
#pragma unroll
    for (int k = 0; k < kN; ++k) w[e][k] = p.v[k];
  }
  __syncthreads();
  if (!inside) return;
  const int64_t end = tokens - t0 < kDxTokens ? tokens - t0 : kDxTokens;
  for (int64_t i0 = 0; i0 < end; i0 += kDxUnroll) {
    Pack<T, kN> d[kDxUnroll];
#pragma unroll
    for (int u = 0; u < kDxUnroll; ++u)
      if (i0 + u < end) d[u] = load_pack<kN>(dx + (t0 + i0 + u) * dim + c);
#pragma unroll
    for (int u = 0; u < kDxUnroll; ++u) {
      if (i0 + u >= end) continue;
      float acc[kN] = {};
#pragma unroll
      for (int e = 0; e < kExpertTile; ++e) {
        if (e >= experts) break;
        const float g = dl[i0 + u][e];  // one address a warp
#pragma unroll
        for (int k = 0; k < kN; ++k) acc[k] = rn::fma(g, w[e][k], acc[k]);
      }
      float out[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) out[k] = rn::add(to_float(d[u].v[k]), acc[k]);
      store_pack<kN>(dx + (t0 + i0 + u) * dim + c, round_pack<T>(out));
    }
  }
}

/// Any number of experts: every weight and dlogit read where it lies, one thread an element.
template <typename T>
__global__ void router_dx_any_kernel(const float* __restrict__ dlogits,
                                     const float* __restrict__ weight, int64_t tokens, int64_t dim,
                                     int64_t experts, T* __restrict__ dx) {
  const int64_t i = global_index();
  if (i >= tokens * dim) return;
  const int64_t t = i / dim, c = i % dim;
  float acc = 0.0f;
  for (int64_t e = 0; e < experts; ++e)
    acc = rn::fma(dlogits[t * experts + e], weight[e * dim + c], acc);
  dx[i] = from_float<T>(rn::add(to_float(dx[i]), acc));
}

// ----------------------------------------------------------------------------
// dweight = dlogits^T x, per tile, then the tiles in order

constexpr int kDwThreads = 128;
constexpr int kDwUnroll = 8;  ///< tokens whose x loads are in flight together
constexpr int kDwTile = static_cast<int>(kRouterTileTokens);
static_assert(kDwTile % kDwUnroll == 0);

/// partial[tile, e, c] = sum over the tile's tokens in order of dlogits[t, e] * x[t, c].
template <typename T, int kN>
__global__ void __launch_bounds__(kDwThreads)
    router_dweight_tiles_kernel(const T* __restrict__ x, const float* __restrict__ dlogits,
                                int64_t tokens, int64_t dim, int64_t experts,
                                float* __restrict__ partial) {
  __shared__ __align__(16) float dl[kDwTile][kExpertTile];
  const int64_t tile = blockIdx.y, t0 = tile * kDwTile;
  const int64_t e0 = static_cast<int64_t>(blockIdx.z) * kExpertTile;
  for (int i = static_cast<int>(threadIdx.x); i < kDwTile * kExpertTile; i += kDwThreads) {
    const int64_t t = t0 + i / kExpertTile, e = e0 + i % kExpertTile;
    dl[i / kExpertTile][i % kExpertTile] =
        t < tokens && e < experts ? dlogits[t * experts + e] : 0.0f;
  }
  __syncthreads();
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kDwThreads + threadIdx.x) * kN;
  if (c >= dim) return;
  const int64_t end = tokens - t0 < kDwTile ? tokens - t0 : kDwTile;
  float acc[kExpertTile][kN] = {};
  for (int64_t i0 = 0; i0 < end; i0 += kDwUnroll) {
    Pack<T, kN> v[kDwUnroll];
#pragma unroll
    for (int u = 0; u < kDwUnroll; ++u)
      if (i0 + u < end) v[u] = load_pack<kN>(x + (t0 + i0 + u) * dim + c);
#pragma unroll
    for (int u = 0; u < kDwUnroll; ++u) {
      if (i0 + u >= end) continue;
#pragma unroll
      for (int e = 0; e < kExpertTile; ++e) {
        const float g = dl[i0 + u][e];  // one address a warp
#pragma unroll
        for (int k = 0; k < kN; ++k) acc[e][k] = rn::fma(g, to_float(v[u].v[k]), acc[e][k]);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kExpertTile; ++e) {
    if (e0 + e >= experts) break;
    float* p = partial + (tile * experts + e0 + e) * dim + c;
#pragma unroll
    for (int k = 0; k < kN; ++k) p[k] = acc[e][k];
  }
}

/// dweight[e, c] (+)= the sum of the tiles' partials in tile order, from +0.
__global__ void router_dweight_sum_kernel(const float* __restrict__ partial, int64_t tiles,
                                          int64_t size, bool accumulate,
                                          float* __restrict__ dweight) {
  const int64_t i = global_index();
  if (i >= size) return;
  float total = 0.0f;
  for (int64_t tile = 0; tile < tiles; ++tile) total = rn::add(total, partial[tile * size + i]);
  dweight[i] = accumulate ? rn::add(dweight[i], total) : total;
}

unsigned grid_dim(int64_t n, const char* what) {
  OCTET_CHECK(n <= kMaxGridY, "router_logits: ", n, " ", what, " exceed the grid's limit of ",
              kMaxGridY);
  return static_cast<unsigned>(n);
}

}  // namespace

void router_logits(const Tensor& x, const Tensor& weight, const Tensor& logits) {
  const cudaStream_t stream = octet::cuda::stream(x.device());
  const int64_t tokens = x.rows(), dim = x.cols(), experts = weight.rows();
  const dim3 grid(static_cast<unsigned>(ceil_div(tokens, kFwdTokens)),
                  grid_dim(ceil_div(experts, kExpertTile), "expert tiles"));
  const bool w_vec = dim % 4 == 0 && vector_aligned({weight.raw_data()});
  math::visit_dtype(x.dtype(), [&](auto type) {
    using T = decltype(type);
    visit_pack<T>(dim, {x.raw_data()}, [&](auto pack) {
      constexpr int kN = decltype(pack)::value;
      const auto launch = [&](auto kernel) {
        kernel<<<grid, kFwdThreads, 0, stream>>>(in<T>(x), in<float>(weight), tokens, dim, experts,
                                                 out<float>(logits));
        OCTET_CHECK_LAUNCH();
      };
      if (w_vec) {
        launch(router_logits_kernel<T, kN, 4>);
      } else {
        launch(router_logits_kernel<T, kN, 1>);
      }
    });
  });
}

void router_logits_backward(const Tensor& x, const Tensor& weight, const Tensor& dlogits,
                            const Tensor& dx, const Tensor& dweight, bool accumulate) {
  const cudaStream_t stream = octet::cuda::stream(x.device());
  const int64_t tokens = x.rows(), dim = x.cols(), experts = weight.rows();
  const int64_t tiles = ceil_div(tokens, kRouterTileTokens);
  const Tensor partial = Tensor::empty({tiles, experts, dim}, DType::f32, x.device());
  math::visit_dtype(x.dtype(), [&](auto type) {
    using T = decltype(type);
    // Two columns a thread where rows allow it: a bf16 pair is one 4-byte access.
    const bool pairs = dim % 2 == 0 && reinterpret_cast<uintptr_t>(x.raw_data()) % 8 == 0 &&
                       reinterpret_cast<uintptr_t>(dx.raw_data()) % 8 == 0 &&
                       reinterpret_cast<uintptr_t>(weight.raw_data()) % 8 == 0;
    const auto by_columns = [&](auto f) {
      if (pairs) {
        f(std::integral_constant<int, 2>{});
      } else {
        f(std::integral_constant<int, 1>{});
      }
    };
    by_columns([&](auto columns) {
      constexpr int kN = decltype(columns)::value;
      if (experts <= kExpertTile) {
        const dim3 grid(static_cast<unsigned>(ceil_div(dim, kDxThreads * kN)),
                        grid_dim(ceil_div(tokens, kDxTokens), "token blocks"));
        router_dx_kernel<T, kN><<<grid, kDxThreads, 0, stream>>>(
            in<float>(dlogits), in<float>(weight), tokens, dim, experts, out<T>(dx));
      } else {
        router_dx_any_kernel<T><<<grid_for(tokens * dim), kThreadsPerBlock, 0, stream>>>(
            in<float>(dlogits), in<float>(weight), tokens, dim, experts, out<T>(dx));
      }
      OCTET_CHECK_LAUNCH();
      const dim3 grid(static_cast<unsigned>(ceil_div(dim, kDwThreads * kN)),
                      grid_dim(tiles, "token tiles"),
                      grid_dim(ceil_div(experts, kExpertTile), "expert tiles"));
      router_dweight_tiles_kernel<T, kN><<<grid, kDwThreads, 0, stream>>>(
          in<T>(x), in<float>(dlogits), tokens, dim, experts, out<float>(partial));
      OCTET_CHECK_LAUNCH();
    });
  });
  router_dweight_sum_kernel<<<grid_for(experts * dim), kThreadsPerBlock, 0, stream>>>(
      in<float>(partial), tiles, experts * dim, accumulate, out<float>(dweight));
  OCTET_CHECK_LAUNCH();
}

}  // namespace octet::ops::cuda
