// Backend entry points of the scaling family (include/octet/ops/scaling.h); see
// quantize_backend.h for the contract between dispatcher and backends.
#pragma once

#include "octet/ops/scaling.h"

namespace octet::ops::cpu {
void update_delayed_scaling(const ScalingGroup* groups, int count, int margin, fp8::AmaxAlgo algo);
void compute_current_scale(const Tensor& amax, const Tensor& scale, const Tensor& scale_inv,
                           float fp8_max, bool power_of_2);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void update_delayed_scaling(const ScalingGroup* groups, int count, int margin, fp8::AmaxAlgo algo);
void compute_current_scale(const Tensor& amax, const Tensor& scale, const Tensor& scale_inv,
                           float fp8_max, bool power_of_2);
}  // namespace octet::ops::cuda
