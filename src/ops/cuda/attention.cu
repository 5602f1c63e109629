// CUDA causal attention (forward and backward).
//
// Two paths compute the same function (the CPU reference in src/ops/cpu/attention.cc):
// - bf16 with head_dim 64 or 128 and 16-byte aligned tensors: flash-attention-2 style kernels on
//   BF16 tensor cores (mma.sync.m16n8k16, f32 accumulation). A CTA of 4 warps owns 16 or 32
//   rows per warp (queries, or keys in the dK/dV kernel; FastTiles and attention_flash.cu say
//   which kernel uses which, and why), and every fragment a warp loads from shared memory (ldmatrix)
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
//
// A third path, cuDNN's fused SDPA (attention_cudnn.cc), runs instead where OCTET_ATTENTION or
// set_attention_choice asks for it (ops::attention_choice()) and the call fits it.
//
// Files: this one holds the entry points, which pick the path, and the row term delta that
// the flash and simple backwards use; attention_flash.{cuh,cu} the tensor-core kernels (on the
// mma.sync, ldmatrix and cp.async helpers of mma_util.cuh); attention_simple.cu the CUDA-core
// kernels; attention_common.cuh what they share; attention_cudnn.{h,cc} the cuDNN path. RoPE is
// in rope.cu.
#include <cuda_runtime.h>

#include <cstdint>

#include "octet/core/cuda_context.h"
#include "ops/attention_backend.h"
#include "ops/cuda/attention_common.cuh"
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/launch_util.cuh"

namespace octet::ops::cuda {
namespace {

// ----------------------------------------------------------------------------
// CUDA kernels: delta, shared by both paths

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
/// 64, too few bytes in flight to keep DRAM busy (a quarter of its peak under Nsight Compute).
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

// ----------------------------------------------------------------------------
// kernel launchers

void check_cuda_shape(const AttentionShape& s, const char* op) {
  OCTET_CHECK(s.head_dim <= kMaxHeadDim, op,
              ": the CUDA backend supports head_dim <= ", kMaxHeadDim, ", got ", s.head_dim);
}

/// The path under attention_choice(): cuDNN when chosen and the call fits it (under auto, only
/// where cuDNN also builds a plan: `cudnn_builds`, asked only then; under cudnn a refusal is the
/// call's error), else what the library ran before cuDNN was a choice: flash where it fits,
/// simple elsewhere.
template <typename CudnnBuilds>
AttentionPath choose_path(bool flash_fits, bool cudnn_fits, CudnnBuilds&& cudnn_builds) {
  const AttentionChoice choice = attention_choice();
  if (choice != AttentionChoice::flash && cudnn_fits &&
      (choice == AttentionChoice::cudnn || cudnn_builds())) {
    return AttentionPath::cudnn;
  }
  return flash_fits ? AttentionPath::flash : AttentionPath::simple;
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

}  // namespace

/// delta = rowsum(dout * out) per (b, h, t), on the stream: the first kernel of every backward.
Tensor attention_row_delta(const Tensor& dout, const Tensor& out, const AttentionShape& s,
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

void attention_forward(const Tensor& qkv, const AttentionShape& shape, const Tensor& out,
                       const Tensor& lse) {
  check_cuda_shape(shape, "attention_forward");
  const Device device = qkv.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const float scale = softmax_scale(shape);
  const auto cudnn_builds = [&] { return cudnn_attention_builds(device, shape, false, scale); };
  switch (choose_path(use_tensor_cores(shape, qkv.dtype(), {&qkv, &out}),
                      cudnn_attention_fits(shape, qkv.dtype(), all_aligned({&qkv, &out})),
                      cudnn_builds)) {
    case AttentionPath::cudnn:
      attention_forward_cudnn(qkv, shape, out, lse, scale, stream);
      break;
    case AttentionPath::flash:
      attention_forward_flash(qkv, shape, out, lse, scale, stream);
      break;
    case AttentionPath::simple:
      attention_forward_simple(qkv, shape, out, lse, scale, stream);
      break;
  }
}

void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                        const AttentionShape& shape, const Tensor& dqkv) {
  check_cuda_shape(shape, "attention_backward");
  const Device device = qkv.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const float scale = softmax_scale(shape);
  const auto cudnn_builds = [&] { return cudnn_attention_builds(device, shape, true, scale); };
  const AttentionPath path =
      choose_path(use_tensor_cores(shape, qkv.dtype(), {&qkv, &dout, &dqkv}),
                  cudnn_attention_fits(shape, qkv.dtype(),
                                       all_aligned({&qkv, &out, &dout, &dqkv})),
                  cudnn_builds);
  if (path == AttentionPath::cudnn) {  // cuDNN computes its own row term
    attention_backward_cudnn(dout, qkv, out, lse, shape, dqkv, scale, stream);
    return;
  }
  const Tensor delta = attention_row_delta(dout, out, shape, stream);
  if (path == AttentionPath::flash) {
    attention_backward_flash(dout, qkv, lse, delta, shape, dqkv, scale, stream);
  } else {
    attention_backward_simple(dout, qkv, lse, delta, shape, dqkv, scale, stream);
  }
}

}  // namespace octet::ops::cuda

namespace octet::ops {

AttentionPath attention_path(const Tensor& qkv, const AttentionShape& shape) {
  OCTET_CHECK(qkv.defined() && qkv.device().is_cuda(),
              "attention_path: the CUDA paths need qkv on a CUDA device, got ", qkv.describe());
  DeviceGuard guard(qkv.device());  // a graph built for auto is built on qkv's device
  const auto cudnn_builds = [&] {
    return cuda::cudnn_attention_builds(qkv.device(), shape, false, cuda::softmax_scale(shape));
  };
  return cuda::choose_path(
      cuda::use_tensor_cores(shape, qkv.dtype(), {&qkv}),
      cuda::cudnn_attention_fits(shape, qkv.dtype(), cuda::all_aligned({&qkv})), cudnn_builds);
}

}  // namespace octet::ops
