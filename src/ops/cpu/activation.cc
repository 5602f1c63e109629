// CPU reference of the activations and the residual add: elementwise loops with OpenMP over the
// scalar formulas of activation_math.h, in f32, rounded once to the tensor's dtype.
#include "ops/activation_backend.h"
#include "ops/activation_math.h"
#include "ops/raw_access.h"

namespace octet::ops::cpu {
namespace {

using math::from_float;
using math::to_float;

template <typename T, Activation kAct>
void forward(const Tensor& x_t, const Tensor& y_t) {
  const T* x = in<T>(x_t);
  T* y = out<T>(y_t);
  if constexpr (kAct == Activation::swiglu) {
    const int64_t rows = y_t.rows(), f = y_t.cols();  // x is [rows, 2f] = [gate | up]
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* gate = x + r * 2 * f;
      const T* up = gate + f;
      for (int64_t c = 0; c < f; ++c)
        y[r * f + c] = from_float<T>(math::swiglu(to_float(gate[c]), to_float(up[c])));
    }
  } else {
    const int64_t n = y_t.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) y[i] = from_float<T>(math::activate<kAct>(to_float(x[i])));
  }
}

template <typename T, Activation kAct>
void backward(const Tensor& dy_t, const Tensor& x_t, const Tensor& dx_t) {
  const T* dy = in<T>(dy_t);
  const T* x = in<T>(x_t);
  T* dx = out<T>(dx_t);
  if constexpr (kAct == Activation::swiglu) {
    const int64_t rows = dy_t.rows(), f = dy_t.cols();  // x and dx are [rows, 2f]
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* gate = x + r * 2 * f;
      const T* up = gate + f;
      T* dgate = dx + r * 2 * f;
      T* dup = dgate + f;
      for (int64_t c = 0; c < f; ++c) {
        const float g = to_float(dy[r * f + c]), gv = to_float(gate[c]), uv = to_float(up[c]);
        dgate[c] = from_float<T>(math::swiglu_dgate(g, gv, uv));
        dup[c] = from_float<T>(math::swiglu_dup(g, gv));
      }
    }
  } else {
    const int64_t n = dy_t.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
      dx[i] = from_float<T>(to_float(dy[i]) * math::activate_grad<kAct>(to_float(x[i])));
  }
}

}  // namespace

void activation_forward(Activation act, const Tensor& x, const Tensor& y) {
  math::visit_dtype(x.dtype(), [&](auto t) {
    math::visit_activation(act, [&](auto a) { forward<decltype(t), decltype(a)::value>(x, y); });
  });
}

void activation_backward(Activation act, const Tensor& dy, const Tensor& x, const Tensor& dx) {
  math::visit_dtype(x.dtype(), [&](auto t) {
    math::visit_activation(act,
                           [&](auto a) { backward<decltype(t), decltype(a)::value>(dy, x, dx); });
  });
}

void add(const Tensor& a, const Tensor& b, const Tensor& o) {
  math::visit_dtype(a.dtype(), [&](auto t) {
    using T = decltype(t);
    const T* pa = in<T>(a);
    const T* pb = in<T>(b);
    T* po = out<T>(o);
    const int64_t n = a.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) po[i] = from_float<T>(to_float(pa[i]) + to_float(pb[i]));
  });
}

}  // namespace octet::ops::cpu
