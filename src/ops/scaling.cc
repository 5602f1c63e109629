// Dispatcher of the scaling family: validates arguments, then runs the CPU or CUDA backend through
// dispatch() (device guard + NVTX range).
#include "octet/ops/scaling.h"

#include <cmath>
#include <string>
#include <vector>

#include "ops/dispatch.h"
#include "ops/scaling_backend.h"

namespace octet::ops {
namespace {

/// Largest accepted margin: 2^-margin must be a nonzero float, and 2^-149 is the smallest one
/// (the least binary32 subnormal).
constexpr int kMaxMargin = 149;

void check_fp8_max(float fp8_max, const char* op) {
  OCTET_CHECK(std::isfinite(fp8_max) && fp8_max > 0.0f, op,
              ": fp8_max must be finite and positive (448 for e4m3, 57344 for e5m2), got ",
              fp8_max);
}

void check_f32_shape(const Tensor& t, const Shape& shape, const char* op, const std::string& what) {
  OCTET_CHECK(t.defined(), op, ": ", what, " is an undefined tensor");
  OCTET_CHECK(t.dtype() == DType::f32 && t.shape() == shape, op, ": ", what, " must be f32",
              shape_str(shape), ", got ", t.describe());
}

}  // namespace

void update_delayed_scaling(const ScalingGroup* groups, int count, int margin, fp8::AmaxAlgo algo) {
  constexpr const char* op = "update_delayed_scaling";
  OCTET_CHECK(count >= 0, op, ": count must be >= 0, got ", count);
  OCTET_CHECK(count == 0 || groups != nullptr, op, ": groups is null but count is ", count);
  OCTET_CHECK(margin >= 0 && margin <= kMaxMargin, op, ": margin must be in [0, ", kMaxMargin,
              "], got ", margin);
  OCTET_CHECK(algo == fp8::AmaxAlgo::max || algo == fp8::AmaxAlgo::most_recent, op,
              ": unknown amax algorithm code ", static_cast<int>(algo),
              "; expected max or most_recent");
  if (count == 0) return;

  NamedTensors tensors;
  for (int g = 0; g < count; ++g) {
    const ScalingGroup& group = groups[g];
    const std::string prefix = "group " + std::to_string(g) + " ";
    const Tensor& history = group.amax_history;
    OCTET_CHECK(history.defined(), op, ": ", prefix, "amax_history is an undefined tensor");
    OCTET_CHECK(history.dtype() == DType::f32 && history.ndim() == 2 && history.size(0) >= 1 &&
                    history.size(1) >= 1,
                op, ": ", prefix, "amax_history must be f32[history_len >= 1, n >= 1], got ",
                history.describe());
    const Shape per_tensor{history.size(1)};
    check_f32_shape(group.scale, per_tensor, op, prefix + "scale");
    check_f32_shape(group.scale_inv, per_tensor, op, prefix + "scale_inv");
    check_fp8_max(group.fp8_max, op);
    tensors.push_back({&group.amax_history, prefix + "amax_history"});
    tensors.push_back({&group.scale, prefix + "scale"});
    tensors.push_back({&group.scale_inv, prefix + "scale_inv"});
    for (const auto& [t, name] :
         {std::pair{&group.next_scale, "next_scale"}, std::pair{&group.last_amax, "last_amax"}}) {
      if (!t->defined()) continue;
      check_f32_shape(*t, per_tensor, op, prefix + name);
      tensors.push_back({t, prefix + name});
    }
  }
  check_same_device(tensors, op);

  dispatch(
      groups[0].amax_history.device(), op,
      [&] { cpu::update_delayed_scaling(groups, count, margin, algo); },
      [&] { OCTET_CUDA_ONLY(cuda::update_delayed_scaling(groups, count, margin, algo)); });
}

void compute_current_scale(const Tensor& amax, const Tensor& scale, const Tensor& scale_inv,
                           float fp8_max, bool power_of_2) {
  constexpr const char* op = "compute_current_scale";
  const Shape scalar{1};
  check_f32_shape(amax, scalar, op, "amax");
  check_f32_shape(scale, scalar, op, "scale");
  check_f32_shape(scale_inv, scalar, op, "scale_inv");
  check_fp8_max(fp8_max, op);
  check_same_device({{&amax, "amax"}, {&scale, "scale"}, {&scale_inv, "scale_inv"}}, op);

  dispatch(
      amax.device(), op,
      [&] { cpu::compute_current_scale(amax, scale, scale_inv, fp8_max, power_of_2); },
      [&] {
        OCTET_CUDA_ONLY(cuda::compute_current_scale(amax, scale, scale_inv, fp8_max, power_of_2));
      });
}

}  // namespace octet::ops
