// Scale computation for the per-tensor recipes: the delayed-scaling history update and current
// scaling. Formulas: docs/NUMERICS.md.
#pragma once

#include "octet/core/tensor.h"
#include "octet/fp8/recipe.h"

namespace octet::ops {

/// The per-tensor scales of one pass of one module (forward: input and weight; backward:
/// grad_output). All tensors f32 and on one device.
struct ScalingGroup {
  Tensor amax_history;  ///< [history_len, n]; row 0 collects the amaxes of the pass in flight
  Tensor scale;         ///< [n]
  Tensor scale_inv;     ///< [n]
  float fp8_max = 0;    ///< of the group's FP8 format
  /// Optional [n]: receives the new scales while `scale` is only read (copy-on-write: whoever
  /// still holds the old scale, such as a Linear's snapshot for recompute, keeps its values).
  /// Undefined: `scale` is updated in place.
  Tensor next_scale;
  /// Optional [n]: receives history row 0 (the amaxes of the pass) before the roll.
  Tensor last_amax;
};

/// Delayed-scaling update of `count` groups, all on one device (one launch on CUDA):
///   amax  = max over the history (or row 0 for most_recent)
///   scale = (fp8_max / amax) / 2^margin, kept when amax is 0, inf or NaN; inf clamps to FLT_MAX
///   scale_inv = 1 / scale; then the history rolls down one row and row 0 becomes zero.
/// The new scale goes to next_scale when that is defined; row 0 is copied to last_amax first.
void update_delayed_scaling(const ScalingGroup* groups, int count, int margin, fp8::AmaxAlgo algo);

/// Current scaling from a just-measured amax (f32[1]): scale = fp8_max / amax (1 when amax is 0,
/// inf or NaN; FLT_MAX when that overflows), optionally rounded down to a power of two; writes
/// scale and scale_inv (f32[1] each, same device).
void compute_current_scale(const Tensor& amax, const Tensor& scale, const Tensor& scale_inv,
                           float fp8_max, bool power_of_2);

}  // namespace octet::ops
