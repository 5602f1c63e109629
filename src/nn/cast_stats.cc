#include "octet/nn/cast_stats.h"

#include "octet/ops/quantize.h"

namespace octet::nn {

CastStats measure_cast(const Tensor& x, const Tensor& codes, const Tensor& scale) {
  CastStats stats;
  const Device& device = x.device();
  Tensor amax = Tensor::zeros({1}, DType::f32, device);
  Tensor counts = Tensor::zeros({3}, DType::i64, device);
  ops::amax(x, amax);
  ops::count_fp8_codes(x, codes, counts);
  const Tensor host_counts = counts.to(Device::cpu());
  const int64_t* c = host_counts.data<int64_t>();
  const auto fraction = [](int64_t part, int64_t whole) {
    return whole == 0 ? 0.0 : static_cast<double>(part) / static_cast<double>(whole);
  };
  stats.measured = true;
  stats.amax = item_f32(amax);
  if (scale.defined()) stats.scale = item_f32(scale);
  stats.saturated_fraction = fraction(c[ops::kSaturatedCodes], x.numel());
  stats.underflow_fraction = fraction(c[ops::kUnderflowCodes], c[ops::kNonzeroInputs]);
  return stats;
}

}  // namespace octet::nn
