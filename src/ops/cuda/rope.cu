// CUDA RoPE (ops::rope): rotates q and k of a packed qkv in place, forward or inverse, in the
// contract's f32 arithmetic (the CPU reference in src/ops/cpu/attention.cc).
//
// The rotation angles depend on (position, pair) only, so a first kernel computes each cos/sin
// once into a table ([seq, head_dim / 2] float2, in L2 for the second); the second rotates with
// 16-byte loads. Evaluating powf and sincosf per element instead (2 x heads x batch times each)
// made RoPE compute-bound at several times its copy time.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "octet/core/cuda_context.h"
#include "ops/attention_backend.h"
#include "ops/cuda/attention_common.cuh"

namespace octet::ops::cuda {
namespace {

/// table[t * half + i] = (cos, sin) of position t's angle for pair i.
__global__ void rope_table_kernel(float2* __restrict__ table, int T, int D, float theta) {
  const int half = D / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(T) * half) return;
  const int i = static_cast<int>(idx % half);
  const int t = static_cast<int>(idx / half);
  // The contract's f32 expression, written identically in the CPU reference.
  const float angle =
      static_cast<float>(t) * powf(theta, -2.0f * static_cast<float>(i) / static_cast<float>(D));
  float sn, cs;
  sincosf(angle, &sn, &cs);
  table[idx] = make_float2(cs, sn);
}

/// kPairs adjacent pairs of one (token, q or k, head) row, moved as one aligned vector.
template <typename Elem, int kPairs>
struct alignas(sizeof(Elem) * 2 * kPairs) Pairs {
  Elem e[2 * kPairs];
};

/// RoPE in place, one thread per kPairs pairs: (token, q or k, head, pairs i0 .. i0 + kPairs).
template <typename Elem, int kPairs>
__global__ void rope_kernel(Elem* __restrict__ qkv, const float2* __restrict__ table,
                            int64_t chunks, int T, int H, int D, bool inverse) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= chunks) return;
  const int half = D / 2;
  const int per_row = half / kPairs;
  const int i0 = static_cast<int>(idx % per_row) * kPairs;
  int64_t rest = idx / per_row;
  const int h = static_cast<int>(rest % H);
  rest /= H;
  const int part = static_cast<int>(rest % 2);  // 0: q, 1: k
  const int64_t token = rest / 2;
  const int t = static_cast<int>(token % T);
  auto* p = reinterpret_cast<Pairs<Elem, kPairs>*>(
      qkv + token * 3 * H * D + (static_cast<int64_t>(part) * H + h) * D + 2 * i0);
  Pairs<Elem, kPairs> v = *p;
  const float2* angles = table + static_cast<int64_t>(t) * half + i0;
#pragma unroll
  for (int k = 0; k < kPairs; ++k) {
    const float cs = angles[k].x, sn = inverse ? -angles[k].y : angles[k].y;
    const float x0 = to_f32(v.e[2 * k]), x1 = to_f32(v.e[2 * k + 1]);
    store_f32(&v.e[2 * k], x0 * cs - x1 * sn);
    store_f32(&v.e[2 * k + 1], x0 * sn + x1 * cs);
  }
  *p = v;
}

template <typename Elem, int kPairs>
void rotate(const Tensor& qkv, const float2* table, const AttentionShape& s, bool inverse,
            cudaStream_t stream) {
  const int64_t chunks = s.batch * s.seq * 2 * s.heads * (s.head_dim / 2 / kPairs);
  rope_kernel<Elem, kPairs>
      <<<grid_for(chunks, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
          static_cast<Elem*>(qkv.raw_data()), table, chunks, static_cast<int>(s.seq),
          static_cast<int>(s.heads), static_cast<int>(s.head_dim), inverse);
  OCTET_CHECK_LAUNCH();
}

/// 16 bytes a thread where every row's pairs start 16-byte aligned, else one pair a thread.
template <typename Elem>
void rotate_typed(const Tensor& qkv, const float2* table, const AttentionShape& s, bool inverse,
                  cudaStream_t stream) {
  constexpr int kVectorPairs = 16 / (2 * sizeof(Elem));
  const bool aligned =
      reinterpret_cast<uintptr_t>(qkv.raw_data()) % 16 == 0 && (s.head_dim / 2) % kVectorPairs == 0;
  if (aligned) {
    rotate<Elem, kVectorPairs>(qkv, table, s, inverse, stream);
  } else {
    rotate<Elem, 1>(qkv, table, s, inverse, stream);
  }
}

}  // namespace

void rope(const Tensor& qkv, const AttentionShape& shape, float theta, bool inverse) {
  const Device device = qkv.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const int64_t entries = shape.seq * (shape.head_dim / 2);
  const Tensor table = Tensor::empty({entries, 2}, DType::f32, device);
  auto* angles = static_cast<float2*>(table.raw_data());
  rope_table_kernel<<<grid_for(entries, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      angles, static_cast<int>(shape.seq), static_cast<int>(shape.head_dim), theta);
  OCTET_CHECK_LAUNCH();
  if (qkv.dtype() == DType::bf16) {
    rotate_typed<uint16_t>(qkv, angles, shape, inverse, stream);
  } else {
    rotate_typed<float>(qkv, angles, shape, inverse, stream);
  }
}

}  // namespace octet::ops::cuda
