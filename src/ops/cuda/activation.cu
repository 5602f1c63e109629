// CUDA activations (GELU tanh, SwiGLU, SReLU) forward and backward, and the residual add:
// grid-stride elementwise kernels over 16-byte packs when the sizes and pointers allow, the scalar
// formulas of activation_math.h, the fused FP8 cast of the output in the pass that stores it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "octet/core/cuda_context.h"
#include "ops/activation_backend.h"
#include "ops/activation_math.h"
#include "ops/cuda/fused_cast.cuh"

namespace octet::ops::cuda {
namespace {

constexpr int kThreads = 256;
/// Grid-stride CTAs per SM: 8 x 256 threads fill an SM of sm_90 (2048 resident threads); more
/// CTAs would only add amax publications.
constexpr int kCtasPerSm = 8;

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// ----------------------------------------------------------------------------
// CUDA kernels

/// y = act(x) over `packs` packs of kN output elements. swiglu: x is [rows, 2f] = [gate | up],
/// y is [rows, f] (f a multiple of kN, so a pack never straddles a row).
template <typename T, int kN, Activation kAct>
__global__ void activation_forward_kernel(const T* x, T* y, int64_t packs, int64_t f,
                                          FusedCast cast) {
  __shared__ uint32_t amax_scratch[kWarpSize];
  CastThread ct(cast);
  for (int64_t p = thread_index(); p < packs; p += grid_stride()) {
    const int64_t i = p * kN;
    float out[kN];
    if constexpr (kAct == Activation::swiglu) {
      const int64_t gi = (i / f) * 2 * f + i % f;
      const Pack<T, kN> gate = load_pack<kN>(x + gi);
      const Pack<T, kN> up = load_pack<kN>(x + gi + f);
#pragma unroll
      for (int k = 0; k < kN; ++k)
        out[k] = math::swiglu(math::to_float(gate.v[k]), math::to_float(up.v[k]));
    } else {
      const Pack<T, kN> v = load_pack<kN>(x + i);
#pragma unroll
      for (int k = 0; k < kN; ++k) out[k] = math::activate<kAct>(math::to_float(v.v[k]));
    }
    store_output<T, kN>(y, i, out, ct);
  }
  finish_cast(ct, amax_scratch);
}

/// dx = act'(x) * dy over `packs` packs of kN elements of dy. swiglu: dy is [rows, f], x and dx
/// are [rows, 2f]; each pack of dy gives a pack of dgate and one of dup.
template <typename T, int kN, Activation kAct>
__global__ void activation_backward_kernel(const T* dy, const T* x, T* dx, int64_t packs, int64_t f,
                                           FusedCast cast) {
  __shared__ uint32_t amax_scratch[kWarpSize];
  CastThread ct(cast);
  for (int64_t p = thread_index(); p < packs; p += grid_stride()) {
    const int64_t i = p * kN;
    const Pack<T, kN> g = load_pack<kN>(dy + i);
    if constexpr (kAct == Activation::swiglu) {
      const int64_t gi = (i / f) * 2 * f + i % f;
      const Pack<T, kN> gate = load_pack<kN>(x + gi);
      const Pack<T, kN> up = load_pack<kN>(x + gi + f);
      float dgate[kN], dup[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const float gk = math::to_float(g.v[k]), gate_k = math::to_float(gate.v[k]);
        dgate[k] = math::swiglu_dgate(gk, gate_k, math::to_float(up.v[k]));
        dup[k] = math::swiglu_dup(gk, gate_k);
      }
      store_output<T, kN>(dx, gi, dgate, ct);
      store_output<T, kN>(dx, gi + f, dup, ct);
    } else {
      const Pack<T, kN> v = load_pack<kN>(x + i);
      float out[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k)
        out[k] = math::to_float(g.v[k]) * math::activate_grad<kAct>(math::to_float(v.v[k]));
      store_output<T, kN>(dx, i, out, ct);
    }
  }
  finish_cast(ct, amax_scratch);
}

/// out = a + b over `packs` packs; out may alias a or b (each element is read, then written, by
/// one thread).
template <typename T, int kN>
__global__ void add_kernel(const T* a, const T* b, T* out, int64_t packs) {
  CastThread no_cast(FusedCast{});
  for (int64_t p = thread_index(); p < packs; p += grid_stride()) {
    const int64_t i = p * kN;
    const Pack<T, kN> va = load_pack<kN>(a + i);
    const Pack<T, kN> vb = load_pack<kN>(b + i);
    float sum[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) sum[k] = math::to_float(va.v[k]) + math::to_float(vb.v[k]);
    store_output<T, kN>(out, i, sum, no_cast);
  }
}

// ----------------------------------------------------------------------------
// kernel launchers

/// CTAs for `packs` packs: one pack per thread, capped at what fills the GPU (grid-stride).
unsigned grid_for(const Device& device, int64_t packs) {
  const int64_t full =
      static_cast<int64_t>(octet::cuda::properties(device).multiProcessorCount) * kCtasPerSm;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(ceil_div(packs, kThreads), full)));
}

/// Runs f(T{}, kN) with the element type and 16-byte packs when `unit` (the extent a pack must
/// not straddle) is a multiple of the pack and every pointer is aligned; else one element at a
/// time.
template <typename F>
void visit_layout(DType dtype, int64_t unit, std::initializer_list<const void*> pointers, F&& f) {
  math::visit_dtype(dtype, [&](auto t) {
    constexpr int kN = kVectorWidth<decltype(t)>;
    if (unit % kN == 0 && vector_aligned(pointers)) {
      f(t, std::integral_constant<int, kN>{});
    } else {
      f(t, std::integral_constant<int, 1>{});
    }
  });
}

/// The extent a pack must not straddle: a row of the output for swiglu (its gate and up halves
/// are separate runs), the whole tensor otherwise.
int64_t pack_unit(Activation act, const Tensor& out_shaped) {
  return act == Activation::swiglu ? out_shaped.cols() : out_shaped.numel();
}

}  // namespace

void activation_forward(Activation act, const Tensor& x, const Tensor& y, const FusedCast& cast) {
  const Device& device = x.device();
  DeviceGuard guard(device);
  const cudaStream_t stream = octet::cuda::stream(device);
  math::visit_activation(act, [&](auto a) {
    constexpr Activation kAct = decltype(a)::value;
    visit_layout(
        x.dtype(), pack_unit(act, y), {x.raw_data(), y.raw_data(), cast.data}, [&](auto t, auto n) {
          using T = decltype(t);
          constexpr int kN = decltype(n)::value;
          const int64_t packs = y.numel() / kN;
          activation_forward_kernel<T, kN, kAct><<<grid_for(device, packs), kThreads, 0, stream>>>(
              static_cast<const T*>(x.raw_data()), static_cast<T*>(y.raw_data()), packs, y.cols(),
              cast);
          OCTET_CHECK_LAUNCH();
        });
  });
}

void activation_backward(Activation act, const Tensor& dy, const Tensor& x, const Tensor& dx,
                         const FusedCast& cast) {
  const Device& device = x.device();
  DeviceGuard guard(device);
  const cudaStream_t stream = octet::cuda::stream(device);
  math::visit_activation(act, [&](auto a) {
    constexpr Activation kAct = decltype(a)::value;
    visit_layout(
        x.dtype(), pack_unit(act, dy), {dy.raw_data(), x.raw_data(), dx.raw_data(), cast.data},
        [&](auto t, auto n) {
          using T = decltype(t);
          constexpr int kN = decltype(n)::value;
          const int64_t packs = dy.numel() / kN;
          activation_backward_kernel<T, kN, kAct><<<grid_for(device, packs), kThreads, 0, stream>>>(
              static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()),
              static_cast<T*>(dx.raw_data()), packs, dy.cols(), cast);
          OCTET_CHECK_LAUNCH();
        });
  });
}

void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  const Device& device = a.device();
  DeviceGuard guard(device);
  const cudaStream_t stream = octet::cuda::stream(device);
  visit_layout(a.dtype(), a.numel(), {a.raw_data(), b.raw_data(), out.raw_data()},
               [&](auto t, auto n) {
                 using T = decltype(t);
                 constexpr int kN = decltype(n)::value;
                 const int64_t packs = a.numel() / kN;
                 add_kernel<T, kN><<<grid_for(device, packs), kThreads, 0, stream>>>(
                     static_cast<const T*>(a.raw_data()), static_cast<const T*>(b.raw_data()),
                     static_cast<T*>(out.raw_data()), packs);
                 OCTET_CHECK_LAUNCH();
               });
}

}  // namespace octet::ops::cuda
