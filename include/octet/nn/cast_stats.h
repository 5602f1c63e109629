// What an FP8 cast did to its tensor: the FP8 statistics that metrics.jsonl reports per layer for
// the input, the weight and the gradient of every FP8 Linear.
#pragma once

#include "octet/core/tensor.h"

namespace octet::nn {

struct CastStats {
  bool measured = false;
  float amax = 0;                 ///< max |x| of the high-precision tensor
  float scale = 0;                ///< the per-tensor scale used (0: block or MXFP8 scales)
  double saturated_fraction = 0;  ///< elements whose code is +-fp8_max
  double underflow_fraction = 0;  ///< nonzero elements whose code is +-0
};

/// Measures the cast of x [rows, cols] into `codes`, its row-wise FP8 copy in x's layout (every
/// recipe's row-wise copy puts code i at element i), with `scale` (f32[1], or undefined for block
/// scales). Counts on x's device; only the results cross to the host.
CastStats measure_cast(const Tensor& x, const Tensor& codes, const Tensor& scale);

}  // namespace octet::nn
