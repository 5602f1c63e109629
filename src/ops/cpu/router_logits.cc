// CPU reference of the router's GEMM (router_logits and its backward): every output is one fma
// chain in the order include/octet/ops/moe.h states, as the CUDA kernels compute it, so both
// backends give the same bits.
#include <vector>

#include "ops/moe_backend.h"
#include "ops/moe_math.h"
#include "ops/raw_access.h"

namespace octet::ops::cpu {

using math::from_float;
using math::to_float;

void router_logits(const Tensor& x, const Tensor& weight, const Tensor& logits) {
  const int64_t tokens = x.rows(), dim = x.cols(), experts = weight.rows();
  const float* w = in<float>(weight);
  float* l = out<float>(logits);
  math::visit_dtype(x.dtype(), [&](auto type) {
    using T = decltype(type);
    const T* xs = in<T>(x);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t e = 0; e < experts; ++e) {
        float acc = 0.0f;
        for (int64_t k = 0; k < dim; ++k)
          acc = rn::fma(to_float(xs[t * dim + k]), w[e * dim + k], acc);
        l[t * experts + e] = acc;
      }
  });
}

void router_logits_backward(const Tensor& x, const Tensor& weight, const Tensor& dlogits,
                            const Tensor& dx, const Tensor& dweight, bool accumulate) {
  const int64_t tokens = x.rows(), dim = x.cols(), experts = weight.rows();
  const float* w = in<float>(weight);
  const float* dl = in<float>(dlogits);
  float* dw = out<float>(dweight);
  math::visit_dtype(x.dtype(), [&](auto type) {
    using T = decltype(type);
    const T* xs = in<T>(x);
    T* d = out<T>(dx);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t k = 0; k < dim; ++k) {
        float acc = 0.0f;
        for (int64_t e = 0; e < experts; ++e)
          acc = rn::fma(dl[t * experts + e], w[e * dim + k], acc);
        d[t * dim + k] = from_float<T>(rn::add(to_float(d[t * dim + k]), acc));
      }
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t k = 0; k < dim; ++k) {
        float total = 0.0f;
        for (int64_t t0 = 0; t0 < tokens; t0 += kRouterTileTokens) {
          float tile = 0.0f;
          for (int64_t t = t0; t < tokens && t < t0 + kRouterTileTokens; ++t)
            tile = rn::fma(dl[t * experts + e], to_float(xs[t * dim + k]), tile);
          total = rn::add(total, tile);
        }
        dw[e * dim + k] = accumulate ? rn::add(dw[e * dim + k], total) : total;
      }
  });
}

}  // namespace octet::ops::cpu
