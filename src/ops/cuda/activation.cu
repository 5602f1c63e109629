// CUDA activations (GELU tanh, SwiGLU, SReLU) forward and backward, and the residual add:
// grid-stride elementwise kernels over 16-byte packs when the sizes and pointers allow, and the
// scalar formulas of activation_math.h. With a fused FP8 cast, the activation computes its output
// straight into the tiles of the tile quantizer (quantize_tile.cuh), which writes both FP8 copies
// (and a bias gradient's column sums) in the same pass; the high-precision output is then
// optional.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "octet/core/cuda_context.h"
#include "ops/activation_backend.h"
#include "ops/activation_math.h"
#include "ops/cuda/fused_cast.cuh"
#include "ops/cuda/launch_util.cuh"
#include "ops/cuda/quantize_tile.cuh"

namespace octet::ops::cuda {
namespace {

constexpr int kThreads = 256;
/// Grid-stride CTAs per SM: 8 x 256 threads fill an SM of sm_90 (2048 resident threads); more
/// CTAs would only add amax publications.
constexpr int kCtasPerSm = 8;

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
__global__ void activation_forward_kernel(const T* x, T* y, int64_t packs, int64_t f) {
  CastThread no_cast(FusedCast{});
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
    store_output<T, kN>(y, i, out, no_cast);
  }
}

/// dx = act'(x) * dy over `packs` packs of kN elements of dy. swiglu: dy is [rows, f], x and dx
/// are [rows, 2f]; each pack of dy gives a pack of dgate and one of dup.
template <typename T, int kN, Activation kAct>
__global__ void activation_backward_kernel(const T* dy, const T* x, T* dx, int64_t packs,
                                           int64_t f) {
  CastThread no_cast(FusedCast{});
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
      store_output<T, kN>(dx, gi, dgate, no_cast);
      store_output<T, kN>(dx, gi + f, dup, no_cast);
    } else {
      const Pack<T, kN> v = load_pack<kN>(x + i);
      float out[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k)
        out[k] = math::to_float(g.v[k]) * math::activate_grad<kAct>(math::to_float(v.v[k]));
      store_output<T, kN>(dx, i, out, no_cast);
    }
  }
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

/// The tile quantizer's Source for an activation: the output (forward: act(x); backward: dx) of
/// tile cells computed from the inputs with the elementwise kernels' formulas, rounded to T as the
/// elementwise kernels store it, and also stored to `out` when that is set. The matrix is the
/// output, [rows, cols]; swiglu's x is [rows, 2f] = [gate | up] (forward: cols = f; backward:
/// cols = 2f = dgate | dup, and dy is [rows, f]); otherwise x and dy are [rows, cols].
template <typename T, Activation kAct, bool kBackward>
struct ActivationTile {
  const T* x;
  const T* dy;  ///< backward only
  T* out;       ///< optional
  int64_t f;    ///< swiglu's gate width (else unused)
  bool vec;     ///< every pointer 16-byte aligned, cols and f multiples of a 16-byte pack

  using L = quant::TileLayout<T>;
  static constexpr int kE = L::kChunkElems;

  /// Output element (r, c) of the matrix, in f32.
  __device__ float element(int64_t r, int64_t c, int64_t cols) const {
    if constexpr (kAct == Activation::swiglu) {
      const T* row = x + r * 2 * f;
      if constexpr (!kBackward) {
        return math::swiglu(math::to_float(row[c]), math::to_float(row[f + c]));
      } else if (c < f) {
        return math::swiglu_dgate(math::to_float(dy[r * f + c]), math::to_float(row[c]),
                                  math::to_float(row[f + c]));
      } else {
        return math::swiglu_dup(math::to_float(dy[r * f + c - f]), math::to_float(row[c - f]));
      }
    } else if constexpr (!kBackward) {
      return math::activate<kAct>(math::to_float(x[r * cols + c]));
    } else {
      return math::to_float(dy[r * cols + c]) *
             math::activate_grad<kAct>(math::to_float(x[r * cols + c]));
    }
  }

  /// The kE output elements (r, c ... c + kE - 1), all inside the matrix, by 16-byte loads (vec:
  /// swiglu's pack then lies in one half, since f is a multiple of kE).
  __device__ void chunk(int64_t r, int64_t c, int64_t cols, float (&v)[kE]) const {
    if constexpr (kAct == Activation::swiglu) {
      const T* row = x + r * 2 * f;
      if constexpr (!kBackward) {
        const Pack<T, kE> gate = load_pack<kE>(row + c), up = load_pack<kE>(row + f + c);
#pragma unroll
        for (int k = 0; k < kE; ++k)
          v[k] = math::swiglu(math::to_float(gate.v[k]), math::to_float(up.v[k]));
      } else if (c < f) {
        const Pack<T, kE> g = load_pack<kE>(dy + r * f + c), gate = load_pack<kE>(row + c),
                          up = load_pack<kE>(row + f + c);
#pragma unroll
        for (int k = 0; k < kE; ++k)
          v[k] = math::swiglu_dgate(math::to_float(g.v[k]), math::to_float(gate.v[k]),
                                    math::to_float(up.v[k]));
      } else {
        const Pack<T, kE> g = load_pack<kE>(dy + r * f + c - f), gate = load_pack<kE>(row + c - f);
#pragma unroll
        for (int k = 0; k < kE; ++k)
          v[k] = math::swiglu_dup(math::to_float(g.v[k]), math::to_float(gate.v[k]));
      }
    } else {
      const Pack<T, kE> in = load_pack<kE>(x + r * cols + c);
      if constexpr (!kBackward) {
#pragma unroll
        for (int k = 0; k < kE; ++k) v[k] = math::activate<kAct>(math::to_float(in.v[k]));
      } else {
        const Pack<T, kE> g = load_pack<kE>(dy + r * cols + c);
#pragma unroll
        for (int k = 0; k < kE; ++k)
          v[k] = math::to_float(g.v[k]) * math::activate_grad<kAct>(math::to_float(in.v[k]));
      }
    }
  }

  /// Chunks of the tile each thread stages; chunk i of a thread is tile chunk threadIdx.x + i *
  /// kTileThreads, as in quant::load_tile.
  static constexpr int kChunks = quant::kTile * L::kChunksPerRow / quant::kTileThreads;
  static_assert(quant::kTile * L::kChunksPerRow % quant::kTileThreads == 0, "whole chunks");

  /// Stores the output chunk o of tile cell (r, j) = matrix (gr, gc) to the tile, and to `out`.
  __device__ void put(const quant::TileParams& p, T* tile, int r, int j, int64_t gr, int64_t gc,
                      bool full, const Pack<T, kE>& o) const {
    if (out != nullptr && full) store_pack<kE>(out + gr * p.cols + gc, o);
    store_pack<kE>(tile + L::chunk_offset(r, j), o);
  }

  /// A chunk that is not whole inside the matrix (or without vector access): element by element
  /// from global memory, 0 outside the matrix.
  __device__ Pack<T, kE> edge_chunk(const quant::TileParams& p, int64_t gr, int64_t gc) const {
    Pack<T, kE> o;
#pragma unroll
    for (int k = 0; k < kE; ++k) {
      const bool inside = gr < p.rows && gc + k < p.cols;
      o.v[k] = inside ? math::from_float<T>(element(gr, gc + k, p.cols)) : T(0);
      if (inside && out != nullptr) out[gr * p.cols + gc + k] = o.v[k];
    }
    return o;
  }

  __device__ void stage(const quant::TileParams& p, T* tile, int64_t r0, int64_t c0) const {
    // Synchronous loads, four chunks in flight: an in-place variant that staged x by cp.async
    // (all chunks in flight, the output computed in shared memory) is slower, by about a third in
    // both directions (docs/PERFORMANCE.md, "Designs that measured slower").
#pragma unroll 4
    for (int i = 0; i < kChunks; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * quant::kTileThreads;
      const int r = idx / L::kChunksPerRow, j = idx % L::kChunksPerRow;
      const int64_t gr = r0 + r, gc = c0 + static_cast<int64_t>(j) * kE;
      const bool full = vec && gr < p.rows && gc + kE <= p.cols;
      Pack<T, kE> o;
      if (full) {
        float v[kE];
        chunk(gr, gc, p.cols, v);
        o = round_pack<T>(v);
      } else {
        o = edge_chunk(p, gr, gc);
      }
      put(p, tile, r, j, gr, gc, full, o);
    }
    __syncthreads();
  }
};

/// Runs the tile quantizer over the activation's output; returns whether it added the column
/// sums (see quant::quantize_tiles).
template <bool kBackward>
bool quantize_activation(Activation act, const Tensor& dy, const Tensor& x, const Tensor& out,
                         int64_t rows, int64_t cols, fp8::QuantizedTensor& q,
                         const QuantizeArgs& args) {
  const Device& device = x.device();
  bool sums_done = false;
  math::visit_activation(act, [&](auto a) {
    constexpr Activation kAct = decltype(a)::value;
    math::visit_dtype(x.dtype(), [&](auto t) {
      using T = decltype(t);
      using Source = ActivationTile<T, kAct, kBackward>;
      Source source{};
      source.x = static_cast<const T*>(x.raw_data());
      source.dy = kBackward ? static_cast<const T*>(dy.raw_data()) : nullptr;
      source.out = out.defined() ? static_cast<T*>(out.raw_data()) : nullptr;
      source.f = kAct == Activation::swiglu ? x.cols() / 2 : cols;
      source.vec = cols % Source::kE == 0 && source.f % Source::kE == 0 &&
                   vector_aligned({source.x, source.dy, source.out});
      sums_done = quant::quantize_tiles<T>(rows, cols, q, args, source, device);
    });
  });
  return sums_done;
}

}  // namespace

bool activation_forward_quantized(Activation act, const Tensor& x, const Tensor& y,
                                  fp8::QuantizedTensor& q, const QuantizeArgs& args) {
  DeviceGuard guard(x.device());
  return quantize_activation<false>(act, Tensor(), x, y, x.rows(), q.cols, q, args);
}

bool activation_backward_quantized(Activation act, const Tensor& dy, const Tensor& x,
                                   const Tensor& dx, fp8::QuantizedTensor& q,
                                   const QuantizeArgs& args) {
  DeviceGuard guard(x.device());
  return quantize_activation<true>(act, dy, x, dx, x.rows(), x.cols(), q, args);
}

namespace {

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
    visit_pack<decltype(t)>(unit, pointers, [&](auto pack) { f(t, pack); });
  });
}

/// The extent a pack must not straddle: a row of the output for swiglu (its gate and up halves
/// are separate runs), the whole tensor otherwise.
int64_t pack_unit(Activation act, const Tensor& out_shaped) {
  return act == Activation::swiglu ? out_shaped.cols() : out_shaped.numel();
}

}  // namespace

void activation_forward(Activation act, const Tensor& x, const Tensor& y) {
  const Device& device = x.device();
  DeviceGuard guard(device);
  const cudaStream_t stream = octet::cuda::stream(device);
  math::visit_activation(act, [&](auto a) {
    constexpr Activation kAct = decltype(a)::value;
    visit_layout(x.dtype(), pack_unit(act, y), {x.raw_data(), y.raw_data()}, [&](auto t, auto n) {
      using T = decltype(t);
      constexpr int kN = decltype(n)::value;
      const int64_t packs = y.numel() / kN;
      activation_forward_kernel<T, kN, kAct><<<grid_for(device, packs), kThreads, 0, stream>>>(
          static_cast<const T*>(x.raw_data()), static_cast<T*>(y.raw_data()), packs, y.cols());
      OCTET_CHECK_LAUNCH();
    });
  });
}

void activation_backward(Activation act, const Tensor& dy, const Tensor& x, const Tensor& dx) {
  const Device& device = x.device();
  DeviceGuard guard(device);
  const cudaStream_t stream = octet::cuda::stream(device);
  math::visit_activation(act, [&](auto a) {
    constexpr Activation kAct = decltype(a)::value;
    visit_layout(
        x.dtype(), pack_unit(act, dy), {dy.raw_data(), x.raw_data(), dx.raw_data()},
        [&](auto t, auto n) {
          using T = decltype(t);
          constexpr int kN = decltype(n)::value;
          const int64_t packs = dy.numel() / kN;
          activation_backward_kernel<T, kN, kAct><<<grid_for(device, packs), kThreads, 0, stream>>>(
              static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()),
              static_cast<T*>(dx.raw_data()), packs, dy.cols());
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
