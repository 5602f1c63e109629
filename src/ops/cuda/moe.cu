// CUDA MoE ops: the router (one thread per token, serial over the experts, as the CPU), its
// statistics (one CTA per expert, fixed_order_reduce.h's order), the plan (one CTA per expert
// scanning the routed slots in order: a stable layout with integer work only), and row-parallel
// dispatch / combine (top-1 and top-2 rows of 16-byte packs gathered by cp.async). The scaled
// activation between the experts' GEMMs is in moe_activation.cu. No float atomics anywhere
// (DESIGN.md rule 3), so every output is the same bytes on every run.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <initializer_list>
#include <type_traits>

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

using math::to_float;

/// Threads of the element-parallel kernels.
constexpr int kThreads = 256;
/// Threads of every per-row and per-expert reduction: the lanes of the fixed order.
constexpr int kLanes = kMoeDotLanes;
static_assert(kLanes == kThreads, "the row kernels reduce with all their threads");

// ----------------------------------------------------------------------------
// Rows in packs: a row kernel gives each thread kN consecutive elements, kN = kVectorWidth<T> (one
// 16-byte access) when every row allows it (visit_pack), else kN = 1, the element-wise fallback.
// Both do the same float operations on every element.

/// Step 1 of fixed_order_reduce.h's order when a row's terms are computed in packs. The row goes
/// by chunks of kLanes * kN elements; thread i holds the terms of the chunk's elements [kN i,
/// kN i + kN), of which the first `valid` exist, and lane t must fold elements t, t + kLanes, ...
/// in increasing order. The terms cross through `stage` (kLanes * kN floats, 16-byte aligned), so
/// over the chunks of a row lane t adds exactly the elements t + m kLanes, m = 0, 1, ..., in order,
/// as fixed_order_reduce_block does. kN = 1 needs no exchange. Contains barriers for kN > 1: call
/// it from every thread of the CTA.
template <int kN>
__device__ __forceinline__ float fold_chunk(float lane, const float (&term)[kN], int64_t valid,
                                            float* stage) {
  const int t = static_cast<int>(threadIdx.x);
  if constexpr (kN == 1) {
    return t < valid ? SumOp{}(lane, term[0]) : lane;
  } else {
    if (static_cast<int64_t>(t) * kN < valid) {
      Pack<float, kN> pack;
#pragma unroll
      for (int k = 0; k < kN; ++k) pack.v[k] = term[k];
      store_pack<kN>(stage + t * kN, pack);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kN; ++j)
      if (t + j * kLanes < valid) lane = SumOp{}(lane, stage[t + j * kLanes]);
    __syncthreads();  // the next chunk, or the tree, rewrites stage
    return lane;
  }
}

// ----------------------------------------------------------------------------
// CUDA kernels: router

__global__ void router_forward_kernel(const float* logits, const float* bias, int64_t tokens,
                                      int64_t experts, int64_t topk, RouterScoring scoring,
                                      float* scores, int32_t* expert, float* prob, float* lse) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  lse[t] = moe::router_row_forward(logits + t * experts, experts, topk, scoring, bias,
                                   scores + t * experts, expert + t * topk, prob + t * topk);
}

/// CTA e < experts: counts[e] and sums[e] = sum_t scores[t, e]; CTA `experts`: sums[experts] =
/// sum_t lse_t^2. Each in the fixed order of kLanes lanes (the CPU's fixed_order_reduce).
__global__ void router_stats_kernel(const float* scores, const int32_t* expert, const float* lse,
                                    int64_t tokens, int64_t experts, int64_t topk,
                                    int32_t* counts, float* sums) {
  __shared__ float shared[kLanes];
  __shared__ int32_t shared_count[kLanes];
  const int64_t e = blockIdx.x;
  if (e == experts) {
    const float s = fixed_order_reduce_block<kLanes, float>(
        tokens, SumOp{}, [&](int64_t t) { return rn::mul(lse[t], lse[t]); }, shared);
    if (threadIdx.x == 0) sums[experts] = s;
    return;
  }
  const float s = fixed_order_reduce_block<kLanes, float>(
      tokens, SumOp{}, [&](int64_t t) { return scores[t * experts + e]; }, shared);
  const int32_t n = fixed_order_reduce_block<kLanes, int32_t>(
      tokens * topk, SumOp{}, [&](int64_t i) { return expert[i] == e ? 1 : 0; }, shared_count);
  if (threadIdx.x == 0) sums[e] = s, counts[e] = n;
}

__global__ void router_losses_kernel(const int32_t* counts, const float* sums, int64_t tokens,
                                     int64_t experts, int64_t topk, float aux_coef, float z_coef,
                                     float* aux_loss, float* z_loss) {
  aux_loss[0] = aux_coef > 0.0f
                    ? moe::aux_loss_value(aux_coef, counts, sums, tokens, experts, topk)
                    : 0.0f;
  z_loss[0] = z_coef > 0.0f ? moe::z_loss_value(z_coef, sums[experts], tokens) : 0.0f;
}

__global__ void router_backward_kernel(const float* logits, const float* scores,
                                       const int32_t* expert, const float* prob,
                                       const float* dprob, const float* lse, const int32_t* counts,
                                       float aux_coef, float z_scale, int64_t tokens,
                                       int64_t experts, int64_t topk, RouterScoring scoring,
                                       float* dlogits) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  moe::router_row_backward(logits + t * experts, scores + t * experts, expert + t * topk,
                           prob + t * topk, dprob + t * topk, lse[t], counts, aux_coef, z_scale,
                           tokens, experts, topk, scoring, dlogits + t * experts);
}

// ----------------------------------------------------------------------------
// CUDA kernels: plan

/// CTA e scans the slots in order: slot_row[i] = the rank of slot i among e's slots (for
/// expert[i] == e), count[e] = their number.
__global__ void plan_positions_kernel(const int32_t* expert, int64_t slots, int32_t* slot_row,
                                      int32_t* count) {
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int32_t e = static_cast<int32_t>(blockIdx.x);
  int32_t running = 0;
  for (int64_t base = 0; base < slots; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    const int32_t flag = i < slots && expert[i] == e ? 1 : 0;
    int32_t rank = 0, total = 0;
    Scan(scan).ExclusiveSum(flag, rank, total);
    if (flag) slot_row[i] = running + rank;
    running += total;
    __syncthreads();  // scan storage is reused by the next chunk
  }
  if (threadIdx.x == 0) count[e] = running;
}

__global__ void plan_offsets_kernel(const int32_t* count, int64_t experts, int32_t* offsets) {
  offsets[0] = 0;
  for (int64_t e = 0; e < experts; ++e)
    offsets[e + 1] = offsets[e] + static_cast<int32_t>(ceil_div(count[e], kMoeGroupAlign) *
                                                       kMoeGroupAlign);
}

__global__ void plan_scatter_kernel(const int32_t* expert, int64_t slots, int64_t topk,
                                    const int32_t* offsets, int32_t* slot_row, int32_t* row_map) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= slots) return;
  const int32_t row = offsets[expert[i]] + slot_row[i];
  slot_row[i] = row;
  row_map[2 * row] = static_cast<int32_t>(i / topk);
  row_map[2 * row + 1] = static_cast<int32_t>(i % topk);
}

// ----------------------------------------------------------------------------
// CUDA kernels: dispatch and combine (one CTA per row)

/// permuted[r] = x[token of r] or zeros, in `Unit`s (16 bytes when rows allow, else 2).
template <typename Unit>
__global__ void dispatch_kernel(const Unit* x, const int32_t* row_map, int64_t units,
                                Unit* permuted) {
  const int64_t r = blockIdx.x;
  const int32_t t = row_map[2 * r];
  for (int64_t c = threadIdx.x; c < units; c += blockDim.x)
    permuted[r * units + c] = t < 0 ? Unit{} : x[t * units + c];
}

/// Slots whose rows a thread loads before it adds them: top-2 in one batch. Larger batches cost
/// registers (top-4 takes 64 a thread for bf16) and so CTAs per SM.
constexpr int kSlotBatch = 2;

/// acc += w * v (v alone without prob: dispatch's backward) for one slot's pack v: the one add of
/// every combine form, so that each sums a token's slots the same way.
template <typename T, int kN>
__device__ __forceinline__ void add_slot(float (&acc)[kN], const Pack<T, kN>& v, const float* prob,
                                         int64_t slot) {
  const float w = prob != nullptr ? prob[slot] : 1.0f;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const float x = to_float(v.v[k]);
    acc[k] = rn::add(acc[k], prob != nullptr ? rn::mul(w, x) : x);
  }
}

/// y[t] = the sum over token t's slots, in slot order, of prob * rows[slot's row] (the row alone
/// without prob: dispatch's backward). A thread owns packs of kN columns and issues the loads of
/// up to kSlotBatch slots before their adds, so each thread has top-k packs in flight.
template <typename T, int kN>
__global__ void combine_kernel(const T* __restrict__ rows, const float* __restrict__ prob,
                               const int32_t* __restrict__ slot_row, int64_t dim, int64_t topk,
                               T* __restrict__ y) {
  const int64_t t = blockIdx.x;
  const int32_t* slots = slot_row + t * topk;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * kN; c < dim; c += blockDim.x * kN) {
    float acc[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) acc[k] = 0.0f;
    for (int64_t s0 = 0; s0 < topk; s0 += kSlotBatch) {
      Pack<T, kN> v[kSlotBatch];  // raw, so that a pack of bf16 takes 4 registers, not 8
#pragma unroll
      for (int b = 0; b < kSlotBatch; ++b)
        if (s0 + b < topk) v[b] = load_pack<kN>(rows + slots[s0 + b] * dim + c);
#pragma unroll
      for (int b = 0; b < kSlotBatch; ++b)
        if (s0 + b < topk) add_slot(acc, v[b], prob, t * topk + s0 + b);
    }
    store_pack<kN>(y + t * dim + c, round_pack<T>(acc));
  }
}

/// Tokens a staged combine CTA owns, and the CTAs an SM must hold (a full SM's threads: at most
/// 32 registers a thread).
constexpr int kStagedCombineTokens = 2;
constexpr int kStagedCombineCtasPerSm = 8;

/// combine_kernel's sums for rows of 16-byte packs and at most kSlotBatch slots a token, with the
/// gathers staged: a thread copies its packs of its kStagedCombineTokens tokens by cp.async into
/// its own slots of shared memory ([token][slot][thread]) before the first add, so no registers
/// wait on the reads (at most 32 registers: eight CTAs an SM keep 128 KB of gathers in flight,
/// against 48 KB for combine_kernel's six). A thread reads back only what it copied, after its
/// own wait. The same adds in the same order: the same bits.
template <typename T, int kN>
__global__ void __launch_bounds__(kThreads, kStagedCombineCtasPerSm)
    combine_staged_kernel(const T* __restrict__ rows, const float* __restrict__ prob,
                          const int32_t* __restrict__ slot_row, int64_t tokens, int64_t dim,
                          int64_t topk, T* __restrict__ y) {
  static_assert(kN * sizeof(T) == kVectorBytes, "cp.async stages 16-byte packs");
  constexpr int kTokens = kStagedCombineTokens;
  __shared__ uint4 staged[kTokens * kSlotBatch * kThreads];
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTokens;
  const int owned = static_cast<int>(tokens - t0 < kTokens ? tokens - t0 : kTokens);
  const auto slot = [&](int i, int b) {
    return &staged[(i * kSlotBatch + b) * kThreads + threadIdx.x];
  };
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * kN; c < dim; c += kThreads * kN) {
#pragma unroll
    for (int i = 0; i < kTokens; ++i)
#pragma unroll
      for (int b = 0; b < kSlotBatch; ++b)
        if (i < owned && b < topk)
          cp_async_16(slot(i, b), rows + slot_row[(t0 + i) * topk + b] * dim + c);
    cp_async_wait_all();
#pragma unroll
    for (int i = 0; i < kTokens; ++i) {
      if (i >= owned) break;
      float acc[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) acc[k] = 0.0f;
#pragma unroll
      for (int b = 0; b < kSlotBatch; ++b) {
        if (b >= topk) break;
        const Pack<T, kN> v = *reinterpret_cast<const Pack<T, kN>*>(slot(i, b));
        add_slot(acc, v, prob, (t0 + i) * topk + b);
      }
      store_pack<kN>(y + (t0 + i) * dim + c, round_pack<T>(acc));
    }
  }
}

/// CTA r: d_expert_out[r] = prob * dy[token] (0 for padding) and dprob[token, slot] = <dy[token],
/// expert_out[r]> in the fixed order; packs of kN columns, one pass over the row.
template <typename T, int kN>
__global__ void combine_backward_kernel(const T* __restrict__ dy, const T* __restrict__ expert_out,
                                        const float* __restrict__ prob,
                                        const int32_t* __restrict__ row_map, int64_t dim,
                                        int64_t topk, T* __restrict__ d_expert_out,
                                        float* __restrict__ dprob) {
  __shared__ __align__(kVectorBytes) float stage[kLanes * kN];
  const int64_t r = blockIdx.x;
  const int32_t t = row_map[2 * r], s = row_map[2 * r + 1];
  const bool dot = t >= 0 && prob != nullptr;  // uniform across the CTA
  const float p = dot ? prob[t * topk + s] : 1.0f;
  float lane = SumOp::identity<float>();
  for (int64_t c0 = 0; c0 < dim; c0 += kLanes * kN) {
    const int64_t c = c0 + static_cast<int64_t>(threadIdx.x) * kN;
    float term[kN] = {};
    if (c < dim && t < 0) {
      store_zeros<kN>(d_expert_out + r * dim + c);
    } else if (c < dim) {
      float g[kN], e[kN], d[kN];
      load_floats<kN>(dy + t * dim + c, g);
      if (dot) load_floats<kN>(expert_out + r * dim + c, e);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        d[k] = prob != nullptr ? rn::mul(p, g[k]) : g[k];
        if (dot) term[k] = rn::mul(g[k], e[k]);
      }
      store_pack<kN>(d_expert_out + r * dim + c, round_pack<T>(d));
    }
    if (dot) lane = fold_chunk<kN>(lane, term, dim - c0, stage);
  }
  if (!dot) return;
  const float sum = fixed_order_tree<kLanes>(lane, SumOp{}, stage);
  if (threadIdx.x == 0) dprob[t * topk + s] = sum;
}

__global__ void gather_row_probs_kernel(const float* prob, const int32_t* row_map, int64_t rows,
                                        int64_t topk, float* row_prob) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const int32_t t = row_map[2 * r];
  row_prob[r] = t < 0 ? 0.0f : prob[t * topk + row_map[2 * r + 1]];
}

__global__ void scatter_row_probs_kernel(const float* d_row_prob, const int32_t* slot_row,
                                         int64_t slots, float* dprob) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < slots) dprob[i] = d_row_prob[slot_row[i]];
}

// ----------------------------------------------------------------------------
// kernel launchers

unsigned blocks_for(int64_t n) { return static_cast<unsigned>(ceil_div(n, kThreads)); }

/// Runs f(T{}) for an f32 or bf16 tensor.
template <typename F>
void visit(DType dtype, F&& f) {
  math::visit_dtype(dtype, std::forward<F>(f));
}

/// y = the (prob-weighted, when prob is defined) sum of each token's rows of `rows`.
void combine(const Tensor& rows, const Tensor& prob, const MoePlan& plan, const Tensor& y) {
  const cudaStream_t stream = octet::cuda::stream(y.device());
  visit(y.dtype(), [&](auto type) {
    using T = decltype(type);
    visit_pack<T>(y.cols(), {rows.raw_data(), y.raw_data()}, [&](auto pack) {
      constexpr int kN = decltype(pack)::value;
      const float* p = prob.defined() ? in<float>(prob) : nullptr;
      const int64_t topk = plan.slot_row.size(1);
      if constexpr (kN * sizeof(T) == kVectorBytes) {
        if (topk <= kSlotBatch) {
          combine_staged_kernel<T, kN>
              <<<static_cast<unsigned>(ceil_div(y.rows(), kStagedCombineTokens)), kThreads, 0,
                 stream>>>(in<T>(rows), p, in<int32_t>(plan.slot_row), y.rows(), y.cols(), topk,
                           out<T>(y));
          OCTET_CHECK_LAUNCH();
          return;
        }
      }
      combine_kernel<T, kN><<<static_cast<unsigned>(y.rows()), kThreads, 0, stream>>>(
          in<T>(rows), p, in<int32_t>(plan.slot_row), y.cols(), topk, out<T>(y));
      OCTET_CHECK_LAUNCH();
    });
  });
}

}  // namespace

void router_forward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& o) {
  const cudaStream_t stream = octet::cuda::stream(logits.device());
  const int64_t tokens = logits.rows(), experts = logits.cols(), topk = args.topk;
  router_forward_kernel<<<blocks_for(tokens), kThreads, 0, stream>>>(
      in<float>(logits),
      args.selection_bias.defined() ? in<float>(args.selection_bias) : nullptr, tokens, experts,
      topk, args.scoring, out<float>(o.scores), out<int32_t>(o.expert), out<float>(o.prob),
      out<float>(o.lse));
  OCTET_CHECK_LAUNCH();
  const Tensor sums = Tensor::empty({experts + 1}, DType::f32, logits.device());
  router_stats_kernel<<<static_cast<unsigned>(experts + 1), kLanes, 0, stream>>>(
      in<float>(o.scores), in<int32_t>(o.expert), in<float>(o.lse), tokens, experts, topk,
      out<int32_t>(o.counts), out<float>(sums));
  OCTET_CHECK_LAUNCH();
  router_losses_kernel<<<1, 1, 0, stream>>>(in<int32_t>(o.counts), in<float>(sums), tokens,
                                            experts, topk, args.aux_loss_coef, args.z_loss_coef,
                                            out<float>(o.aux_loss), out<float>(o.z_loss));
  OCTET_CHECK_LAUNCH();
}

void router_backward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& s,
                     const Tensor& dprob, const Tensor& dlogits) {
  const cudaStream_t stream = octet::cuda::stream(logits.device());
  const int64_t tokens = logits.rows(), experts = logits.cols();
  const float z_scale =
      args.z_loss_coef > 0.0f ? moe::z_score_scale(args.z_loss_coef, tokens) : 0.0f;
  router_backward_kernel<<<blocks_for(tokens), kThreads, 0, stream>>>(
      in<float>(logits), in<float>(s.scores), in<int32_t>(s.expert), in<float>(s.prob),
      in<float>(dprob), in<float>(s.lse),
      args.aux_loss_coef > 0.0f ? in<int32_t>(s.counts) : nullptr, args.aux_loss_coef, z_scale,
      tokens, experts, args.topk, args.scoring, out<float>(dlogits));
  OCTET_CHECK_LAUNCH();
}

void moe_plan(const Tensor& expert, const MoePlan& plan) {
  const cudaStream_t stream = octet::cuda::stream(expert.device());
  const int64_t slots = expert.numel(), experts = plan.experts();
  const Tensor count = Tensor::empty({experts}, DType::i32, expert.device());
  plan_positions_kernel<<<static_cast<unsigned>(experts), kThreads, 0, stream>>>(
      in<int32_t>(expert), slots, out<int32_t>(plan.slot_row), out<int32_t>(count));
  OCTET_CHECK_LAUNCH();
  plan_offsets_kernel<<<1, 1, 0, stream>>>(in<int32_t>(count), experts,
                                           out<int32_t>(plan.offsets));
  OCTET_CHECK_LAUNCH();
  OCTET_CHECK_CUDA(cudaMemsetAsync(plan.row_map.raw_data(), 0xFF, plan.row_map.nbytes(), stream));
  plan_scatter_kernel<<<blocks_for(slots), kThreads, 0, stream>>>(
      in<int32_t>(expert), slots, expert.size(1), in<int32_t>(plan.offsets),
      out<int32_t>(plan.slot_row), out<int32_t>(plan.row_map));
  OCTET_CHECK_LAUNCH();
}

void moe_dispatch(const Tensor& x, const MoePlan& plan, const Tensor& permuted) {
  const cudaStream_t stream = octet::cuda::stream(x.device());
  const int64_t row_bytes = x.cols() * static_cast<int64_t>(dtype_size(x.dtype()));
  const auto aligned = [](const Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.raw_data()) % sizeof(uint4) == 0;
  };
  const auto grid = static_cast<unsigned>(plan.capacity());
  if (row_bytes % static_cast<int64_t>(sizeof(uint4)) == 0 && aligned(x) && aligned(permuted)) {
    dispatch_kernel<uint4><<<grid, kThreads, 0, stream>>>(
        in<uint4>(x), in<int32_t>(plan.row_map), row_bytes / sizeof(uint4), out<uint4>(permuted));
  } else {
    dispatch_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(
        in<uint16_t>(x), in<int32_t>(plan.row_map), row_bytes / sizeof(uint16_t),
        out<uint16_t>(permuted));
  }
  OCTET_CHECK_LAUNCH();
}

void moe_dispatch_backward(const Tensor& d_permuted, const MoePlan& plan, const Tensor& dx) {
  combine(d_permuted, Tensor(), plan, dx);
}

void moe_combine(const Tensor& expert_out, const Tensor& prob, const MoePlan& plan,
                 const Tensor& y) {
  combine(expert_out, prob, plan, y);
}

void moe_combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& prob,
                          const MoePlan& plan, const Tensor& d_expert_out, const Tensor& dprob) {
  const cudaStream_t stream = octet::cuda::stream(dy.device());
  visit(dy.dtype(), [&](auto type) {
    using T = decltype(type);
    const std::initializer_list<const void*> rows = {
        dy.raw_data(), quant::data_or_null<const void>(expert_out), d_expert_out.raw_data()};
    visit_pack<T>(dy.cols(), rows, [&](auto pack) {
      combine_backward_kernel<T, decltype(pack)::value>
          <<<static_cast<unsigned>(plan.capacity()), kLanes, 0, stream>>>(
              in<T>(dy), quant::data_or_null<const T>(expert_out),
              quant::data_or_null<const float>(prob), in<int32_t>(plan.row_map), dy.cols(),
              plan.slot_row.size(1), out<T>(d_expert_out), quant::data_or_null<float>(dprob));
      OCTET_CHECK_LAUNCH();
    });
  });
}

void moe_gather_row_probs(const Tensor& prob, const MoePlan& plan, const Tensor& row_prob) {
  const cudaStream_t stream = octet::cuda::stream(prob.device());
  gather_row_probs_kernel<<<blocks_for(plan.capacity()), kThreads, 0, stream>>>(
      in<float>(prob), in<int32_t>(plan.row_map), plan.capacity(), plan.slot_row.size(1),
      out<float>(row_prob));
  OCTET_CHECK_LAUNCH();
}

void moe_scatter_row_probs(const Tensor& d_row_prob, const MoePlan& plan, const Tensor& dprob) {
  const cudaStream_t stream = octet::cuda::stream(dprob.device());
  scatter_row_probs_kernel<<<blocks_for(dprob.numel()), kThreads, 0, stream>>>(
      in<float>(d_row_prob), in<int32_t>(plan.slot_row), dprob.numel(), out<float>(dprob));
  OCTET_CHECK_LAUNCH();
}

}  // namespace octet::ops::cuda
