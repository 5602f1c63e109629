// CUDA causal attention on CUDA cores, for what the tensor-core path does not take (f32, other
// head_dims up to kMaxHeadDim, unaligned views): one warp per row, lanes over head_dim, all f32.
// Simple, and fast enough for tests and small models. attention.cu picks the path.
#include <cuda_runtime.h>

#include <cstdint>

#include "octet/core/cuda_context.h"
#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/launch_util.cuh"

namespace octet::ops::cuda {
namespace {

constexpr int kPerLane = kMaxHeadDim / kWarpSize;

// ----------------------------------------------------------------------------
// CUDA kernels: simple path (any dtype, head_dim <= kMaxHeadDim)

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

// ----------------------------------------------------------------------------
// kernel launchers

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

}  // namespace

void attention_forward_simple(const Tensor& qkv, const AttentionShape& s, const Tensor& out,
                              const Tensor& lse, float scale, cudaStream_t stream) {
  if (qkv.dtype() == DType::bf16) {
    forward_simple<uint16_t>(qkv, s, out, lse, scale, stream);
  } else {
    forward_simple<float>(qkv, s, out, lse, scale, stream);
  }
}

void attention_backward_simple(const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                               const Tensor& delta, const AttentionShape& s, const Tensor& dqkv,
                               float scale, cudaStream_t stream) {
  if (qkv.dtype() == DType::bf16) {
    backward_simple<uint16_t>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  } else {
    backward_simple<float>(dout, qkv, lse, delta, s, dqkv, scale, stream);
  }
}

}  // namespace octet::ops::cuda
