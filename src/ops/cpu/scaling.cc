// CPU reference of the scaling family. The formulas and their exact order of float operations are
// the contract in docs/NUMERICS.md ("Delayed scaling", "Current scaling"); the CUDA kernels
// reproduce them bit for bit.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "octet/fp8/format.h"
#include "ops/scaling_backend.h"

namespace octet::ops::cpu {
namespace {

/// Float bits that survive rounding down to a power of two: sign and exponent (IEEE 754 binary32).
constexpr uint32_t kSignExponentMask = 0xFF800000u;

bool usable_amax(float amax) { return std::isfinite(amax) && amax > 0.0f; }

/// A scale that overflowed (amax tiny) becomes the largest finite float: the tensor's amax then
/// maps below fp8_max, the best a finite scale can do.
float clamp_infinite(float scale) { return std::isinf(scale) ? FLT_MAX : scale; }

/// Column j's amax over an [len, n] history: the largest value, NaN when any entry is NaN (so a
/// NaN in the window keeps the old scale, as torch.max does in Transformer Engine).
float history_amax(const float* history, int64_t len, int64_t n, int64_t j, fp8::AmaxAlgo algo) {
  float amax = history[j];
  if (algo == fp8::AmaxAlgo::most_recent) return amax;
  for (int64_t i = 1; i < len && !std::isnan(amax); ++i) {
    const float v = history[i * n + j];
    if (std::isnan(v) || v > amax) amax = v;
  }
  return amax;
}

}  // namespace

void update_delayed_scaling(const ScalingGroup* groups, int count, int margin, fp8::AmaxAlgo algo) {
  // 2^-margin, exact: the dispatcher bounds margin so that it is a nonzero float.
  const float margin_factor = std::ldexp(1.0f, -margin);
  for (int g = 0; g < count; ++g) {
    const ScalingGroup& group = groups[g];
    float* history = group.amax_history.data<float>();
    const float* scale = group.scale.data<float>();
    float* next_scale = (group.next_scale.defined() ? group.next_scale : group.scale).data<float>();
    float* scale_inv = group.scale_inv.data<float>();
    const int64_t len = group.amax_history.size(0);
    const int64_t n = group.amax_history.size(1);
    if (group.last_amax.defined())
      std::memcpy(group.last_amax.data<float>(), history, static_cast<size_t>(n) * sizeof(float));
    for (int64_t j = 0; j < n; ++j) {
      const float amax = history_amax(history, len, n, j, algo);
      float s = scale[j];
      if (usable_amax(amax)) s = clamp_infinite(group.fp8_max / amax * margin_factor);
      next_scale[j] = s;
      scale_inv[j] = 1.0f / s;
    }
    // Roll down one row (the oldest row drops off) and open a fresh row 0 for the next pass.
    std::memmove(history + n, history, static_cast<size_t>((len - 1) * n) * sizeof(float));
    std::memset(history, 0, static_cast<size_t>(n) * sizeof(float));
  }
}

void compute_current_scale(const Tensor& amax, const Tensor& scale, const Tensor& scale_inv,
                           float fp8_max, bool power_of_2) {
  const float a = amax.data<float>()[0];
  float s = usable_amax(a) ? clamp_infinite(fp8_max / a) : 1.0f;
  // s is a positive normal float here, so clearing the mantissa gives 2^floor(log2(s)).
  if (power_of_2) s = fp8::bits_float(fp8::float_bits(s) & kSignExponentMask);
  scale.data<float>()[0] = s;
  scale_inv.data<float>()[0] = 1.0f / s;
}

}  // namespace octet::ops::cpu
