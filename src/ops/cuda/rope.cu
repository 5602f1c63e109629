// CUDA RoPE (ops::rope): rotates q and k of a packed qkv in place, forward or inverse, in the
// contract's f32 arithmetic (the CPU reference in src/ops/cpu/attention.cc).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "octet/core/cuda_context.h"
#include "ops/attention_backend.h"
#include "ops/cuda/attention_common.cuh"

namespace octet::ops::cuda {
namespace {

/// RoPE in place, one thread per rotated pair: (token, q or k, head, pair i).
template <typename Elem>
__global__ void rope_kernel(Elem* __restrict__ qkv, int64_t pairs, int T, int H, int D, float theta,
                            bool inverse) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= pairs) return;
  const int half = D / 2;
  const int i = static_cast<int>(idx % half);
  int64_t rest = idx / half;
  const int h = static_cast<int>(rest % H);
  rest /= H;
  const int part = static_cast<int>(rest % 2);  // 0: q, 1: k
  const int64_t token = rest / 2;
  const int t = static_cast<int>(token % T);
  // The contract's f32 expression, written identically in the CPU reference.
  const float angle =
      static_cast<float>(t) * powf(theta, -2.0f * static_cast<float>(i) / static_cast<float>(D));
  float sn, cs;
  sincosf(angle, &sn, &cs);
  if (inverse) sn = -sn;
  Elem* p = qkv + token * 3 * H * D + (static_cast<int64_t>(part) * H + h) * D + 2 * i;
  const float x0 = to_f32(p[0]), x1 = to_f32(p[1]);
  store_f32(p, x0 * cs - x1 * sn);
  store_f32(p + 1, x0 * sn + x1 * cs);
}

template <typename Elem>
void rope_typed(const Tensor& qkv, const AttentionShape& s, float theta, bool inverse,
                cudaStream_t stream) {
  const int64_t pairs = s.batch * s.seq * 2 * s.heads * (s.head_dim / 2);
  rope_kernel<Elem><<<grid_for(pairs, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      static_cast<Elem*>(qkv.raw_data()), pairs, static_cast<int>(s.seq), static_cast<int>(s.heads),
      static_cast<int>(s.head_dim), theta, inverse);
  OCTET_CHECK_LAUNCH();
}

}  // namespace

void rope(const Tensor& qkv, const AttentionShape& shape, float theta, bool inverse) {
  const Device device = qkv.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  if (qkv.dtype() == DType::bf16) {
    rope_typed<uint16_t>(qkv, shape, theta, inverse, stream);
  } else {
    rope_typed<float>(qkv, shape, theta, inverse, stream);
  }
}

}  // namespace octet::ops::cuda
