// CPU reference of LayerNorm and RMSNorm: plain loops over rows with OpenMP, f32 statistics with
// sequential sums, the scalar formulas of activation_math.h. dgamma and dbeta are reduced per
// fixed tile of rows and the tile partials summed in tile order, so the result does not depend on
// the thread count.
#include <algorithm>
#include <vector>

#include "ops/activation_math.h"
#include "ops/norm_backend.h"

namespace octet::ops::cpu {
namespace {

/// Rows per partial of the dgamma/dbeta reduction: enough tiles to keep the threads busy on the
/// shapes octet trains, few enough that the partials stay small next to the inputs.
constexpr int64_t kRowsPerTile = 32;

using math::from_float;
using math::to_float;

/// Both norms' forward pass; RMSNorm has no mean (statistics around 0) and no beta.
template <typename T, bool kRms>
void norm_forward(const Tensor& x_t, const Tensor& gamma_t, const Tensor& beta_t, float eps,
                  const Tensor& y_t, const Tensor& mean_t, const Tensor& rstd_t) {
  const int64_t rows = x_t.rows(), cols = x_t.cols();
  const float n = static_cast<float>(cols);
  const auto* x = static_cast<const T*>(x_t.raw_data());
  auto* y = static_cast<T*>(y_t.raw_data());
  const float* gamma = gamma_t.data<float>();
  const float* beta = kRms ? nullptr : beta_t.data<float>();
  float* mean_out = kRms ? nullptr : mean_t.data<float>();
  float* rstd_out = rstd_t.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    float mean = 0.0f;
    if constexpr (!kRms) {
      float sum = 0.0f;
      for (int64_t c = 0; c < cols; ++c) sum += to_float(xr[c]);
      mean = sum / n;
    }
    float squares = 0.0f;  // two-pass: around the mean already computed
    for (int64_t c = 0; c < cols; ++c) {
      const float d = to_float(xr[c]) - mean;
      squares += d * d;
    }
    const float rstd = math::norm_rstd(squares / n, eps);
    for (int64_t c = 0; c < cols; ++c) {
      const float b = kRms ? 0.0f : beta[c];
      yr[c] = from_float<T>(math::norm_output(to_float(xr[c]), mean, rstd, gamma[c], b));
    }
    if constexpr (!kRms) mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
}

/// Both norms' backward pass: dx per row; dgamma (and dbeta) (+)= fixed-order column sums.
template <typename T, bool kRms>
void norm_backward(const Tensor& dy_t, const Tensor& x_t, const Tensor& gamma_t,
                   const Tensor& mean_t, const Tensor& rstd_t, const Tensor& dx_t,
                   const Tensor& dgamma_t, const Tensor& dbeta_t, const Tensor& residual_t,
                   bool accumulate) {
  const int64_t rows = x_t.rows(), cols = x_t.cols();
  const float n = static_cast<float>(cols);
  const auto* dy = static_cast<const T*>(dy_t.raw_data());
  const auto* x = static_cast<const T*>(x_t.raw_data());
  auto* dx = static_cast<T*>(dx_t.raw_data());
  const auto* residual =
      residual_t.defined() ? static_cast<const T*>(residual_t.raw_data()) : nullptr;
  const float* gamma = gamma_t.data<float>();
  const float* mean = kRms ? nullptr : mean_t.data<float>();
  const float* rstd = rstd_t.data<float>();
  const int64_t sums = kRms ? 1 : 2;  // dgamma (and dbeta) partials per tile
  const int64_t tiles = (rows + kRowsPerTile - 1) / kRowsPerTile;
  std::vector<float> partial(tiles * sums * cols, 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    float* pg = &partial[tile * sums * cols];
    float* pb = kRms ? nullptr : pg + cols;
    const int64_t end = std::min(rows, (tile + 1) * kRowsPerTile);
    for (int64_t r = tile * kRowsPerTile; r < end; ++r) {
      const T* dyr = dy + r * cols;
      const T* xr = x + r * cols;
      const float m = kRms ? 0.0f : mean[r];
      const float s = rstd[r];
      float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        const float g = to_float(dyr[c]);
        const float xhat = math::norm_xhat(to_float(xr[c]), m, s);
        const float dxhat = g * gamma[c];
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * xhat;
        pg[c] += g * xhat;
        if constexpr (!kRms) pb[c] += g;
      }
      const float mean_dxhat = kRms ? 0.0f : sum_dxhat / n;
      const float mean_dxhat_xhat = sum_dxhat_xhat / n;
      for (int64_t c = 0; c < cols; ++c) {
        const float xhat = math::norm_xhat(to_float(xr[c]), m, s);
        const float dxhat = to_float(dyr[c]) * gamma[c];
        const T g = from_float<T>(math::norm_dx(dxhat, xhat, s, mean_dxhat, mean_dxhat_xhat));
        // As ops::add would: the rounded gradient plus the residual, rounded again.
        dx[r * cols + c] =
            residual ? from_float<T>(to_float(g) + to_float(residual[r * cols + c])) : g;
      }
    }
  }
  // Tile partials in tile order, then one add into the accumulated gradient (or into 0).
  float* dgamma = dgamma_t.data<float>();
  float* dbeta = kRms ? nullptr : dbeta_t.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < cols; ++c) {
    float g = 0.0f, b = 0.0f;
    for (int64_t tile = 0; tile < tiles; ++tile) {
      g += partial[tile * sums * cols + c];
      if constexpr (!kRms) b += partial[tile * sums * cols + cols + c];
    }
    dgamma[c] = (accumulate ? dgamma[c] : 0.0f) + g;
    if constexpr (!kRms) dbeta[c] = (accumulate ? dbeta[c] : 0.0f) + b;
  }
}

}  // namespace

void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                       const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  math::visit_dtype(x.dtype(), [&](auto t) {
    norm_forward<decltype(t), false>(x, gamma, beta, eps, y, mean, rstd);
  });
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, const Tensor& dx, const Tensor& dgamma,
                        const Tensor& dbeta, const Tensor& residual, bool accumulate_params) {
  math::visit_dtype(x.dtype(), [&](auto t) {
    norm_backward<decltype(t), false>(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, residual,
                                      accumulate_params);
  });
}

void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, const Tensor& y,
                     const Tensor& rstd) {
  math::visit_dtype(x.dtype(), [&](auto t) {
    norm_forward<decltype(t), true>(x, gamma, Tensor(), eps, y, Tensor(), rstd);
  });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dgamma, const Tensor& residual,
                      bool accumulate_params) {
  math::visit_dtype(x.dtype(), [&](auto t) {
    norm_backward<decltype(t), true>(dy, x, gamma, Tensor(), rstd, dx, dgamma, Tensor(), residual,
                                     accumulate_params);
  });
}

}  // namespace octet::ops::cpu
