#include "octet/train/step_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <sstream>

#include "octet/core/device.h"
#include "octet/core/error.h"
#include "octet/core/profiler.h"
#include "octet/ops/copy.h"
#include "octet/ops/optimizer.h"
#include "octet/train/model.h"
#include "octet/train/trainer.h"

namespace octet::train {
namespace {

/// Slots of StepChecks' device buffer before the guard's norms.
constexpr int64_t kNormSlot = 0, kAmaxSlot = 1, kGuardSlots = 2;

/// The guard's layer groups in first-appearance order, and each group's gradients.
std::vector<std::string> group_names(const std::vector<Parameter>& params) {
  std::vector<std::string> names;
  for (const Parameter& p : params) {
    const std::string g = layer_group(p.name);
    if (names.empty() || names.back() != g) names.push_back(g);
  }
  return names;
}

void squared_norm(const std::vector<Tensor>& tensors, const Tensor& out) {
  ops::global_norm_squared(tensors.data(), static_cast<int>(tensors.size()), out);
}

}  // namespace

const char* skip_reason_name(SkipReason reason) {
  switch (reason) {
    case SkipReason::none:
      return "none";
    case SkipReason::nonfinite_loss:
      return "non-finite loss";
    case SkipReason::nonfinite_grad:
      return "non-finite gradient";
    case SkipReason::nonfinite_amax:
      return "non-finite amax";
    case SkipReason::guard:
      return "gradient guard";
  }
  return "unknown";
}

nlohmann::json flags_json(const std::vector<GuardFlag>& flags) {
  nlohmann::json out = nlohmann::json::array();
  for (const GuardFlag& f : flags)
    out.push_back({{"layer", f.layer},
                   {"microbatch", f.microbatch},
                   {"z", f.z},
                   {"norm", f.norm},
                   {"band_norm", f.band_norm}});
  return out;
}

std::string describe_flag(const GuardFlag& f) {
  char text[256];
  std::snprintf(text, sizeof text,
                "step %lld: gradient guard: %s at microbatch %lld, norm %.4g against a band "
                "around %.4g (log std %.3f): z %.1f",
                (long long)f.step, f.layer.c_str(), (long long)f.microbatch, f.norm, f.band_norm,
                f.band_std, f.z);
  return text;
}

// ----------------------------------------------------------------------------
// Fp8Snapshot

std::vector<Tensor> fp8_state_tensors(const nn::FP8State& state) {
  std::vector<Tensor> tensors;
  for (nn::Pass pass : {nn::Pass::forward, nn::Pass::backward}) {
    const ops::ScalingGroup& g = state.group(pass);
    for (const Tensor& t : {g.scale, g.scale_inv, g.amax_history}) tensors.push_back(t);
  }
  return tensors;
}

namespace {

/// dst[i] = src[i] for every pair, with one ops::copy_tensors launch per device among the sources
/// (the states of one model normally share one), each device's pairs in the order given.
void copy_per_device(const std::vector<Tensor>& src, const std::vector<Tensor>& dst) {
  std::vector<Device> devices;
  for (const Tensor& t : src)
    if (std::find(devices.begin(), devices.end(), t.device()) == devices.end())
      devices.push_back(t.device());
  if (devices.size() <= 1) {
    ops::copy_tensors(src, dst);
    return;
  }
  for (const Device& device : devices) {
    std::vector<Tensor> from, to;
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i].device() != device) continue;
      from.push_back(src[i]);
      to.push_back(dst[i]);
    }
    ops::copy_tensors(from, to);
  }
}

}  // namespace

void Fp8Snapshot::capture(const std::vector<std::shared_ptr<nn::FP8State>>& states) {
  entries_.resize(states.size());
  std::vector<Tensor> src, dst;
  src.reserve(states.size() * 6);  // fp8_state_tensors: three tensors of each pass
  dst.reserve(states.size() * 6);
  for (size_t i = 0; i < states.size(); ++i) {
    Entry& e = entries_[i];
    const std::vector<Tensor> tensors = fp8_state_tensors(*states[i]);
    if (e.state != states[i] || e.copies.size() != tensors.size()) {
      e.state = states[i];
      e.copies.clear();
      for (const Tensor& t : tensors)
        e.copies.push_back(Tensor::empty(t.shape(), t.dtype(), states[i]->device()));
    }
    src.insert(src.end(), tensors.begin(), tensors.end());
    dst.insert(dst.end(), e.copies.begin(), e.copies.end());
    e.calibrated[0] = states[i]->calibrated(nn::Pass::forward);
    e.calibrated[1] = states[i]->calibrated(nn::Pass::backward);
  }
  copy_per_device(src, dst);
}

void Fp8Snapshot::restore() const {
  std::vector<Tensor> src, dst;
  for (const Entry& e : entries_) {
    const std::vector<Tensor> tensors = fp8_state_tensors(*e.state);
    src.insert(src.end(), e.copies.begin(), e.copies.end());
    dst.insert(dst.end(), tensors.begin(), tensors.end());
    e.state->set_calibrated(nn::Pass::forward, e.calibrated[0]);
    e.state->set_calibrated(nn::Pass::backward, e.calibrated[1]);
  }
  copy_per_device(src, dst);
}

// ----------------------------------------------------------------------------
// StepChecks

StepChecks::StepChecks(GPT& model, const std::vector<Parameter>& params, const TrainOptions& o)
    : model_(model), params_(params), injector_(parse_faults(o.inject), model) {
  for (const Parameter& p : params) grads_.push_back(p.grad);
  int64_t guard_slots = 0;
  if (o.guard || o.guard_skip) {
    std::vector<std::string> names = group_names(params);
    for (const std::string& name : names) {
      group_grads_.emplace_back();
      for (const Parameter& p : params)
        if (layer_group(p.name) == name) group_grads_.back().push_back(p.grad);
    }
    guard_slots = o.accum * static_cast<int64_t>(names.size());
    guard_.emplace(std::move(names), o.accum,
                   GuardConfig{.z = o.guard_z, .warmup = o.guard_warmup});
    guard_skips_ = o.guard_skip;
  }
  buffer_ = Tensor::zeros({kGuardSlots + guard_slots}, DType::f32, model.device());
  norm_sq_ = buffer_.slice(kNormSlot, kNormSlot + 1);
}

StepChecks::~StepChecks() { model_.set_activation_hook(nullptr); }

void StepChecks::begin_step(int64_t) {
  // One profiler entry for the snapshot's copies (they nest inside it), so `octet bench train
  // --profile` shows what the snapshot costs a step.
  DeviceGuard guard(model_.device());
  profiler::OpScope timer(model_.device(), "fp8_snapshot");
  snapshot_.capture(model_.registry().states());
}

void StepChecks::before_microbatch(int64_t step, int64_t micro) {
  if (!injector_.empty()) injector_.before_microbatch(step, micro);
}

void StepChecks::after_microbatch(int64_t step, int64_t micro) {
  if (!injector_.empty()) injector_.after_microbatch(step, micro, params_);
  if (!guard_) return;
  const int64_t groups = static_cast<int64_t>(group_grads_.size());
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t slot = kGuardSlots + micro * groups + g;
    squared_norm(group_grads_[static_cast<size_t>(g)], buffer_.slice(slot, slot + 1));
  }
}

StepVerdict StepChecks::finish(int64_t step, double loss) {
  squared_norm(grads_, norm_sq_);
  std::vector<Tensor> amaxes;
  for (const auto& state : model_.registry().states()) {
    for (nn::Pass pass : {nn::Pass::forward, nn::Pass::backward}) {
      amaxes.push_back(state->group(pass).amax_history);
      amaxes.push_back(state->last_amax(pass));
    }
  }
  if (!amaxes.empty()) squared_norm(amaxes, buffer_.slice(kAmaxSlot, kAmaxSlot + 1));
  const std::vector<float> host = host_values_f32(buffer_);  // the step's one host sync

  StepVerdict v;
  v.grad_norm = std::sqrt(static_cast<double>(host[kNormSlot]));
  if (!std::isfinite(loss)) {
    v.skip = SkipReason::nonfinite_loss;
  } else if (!std::isfinite(v.grad_norm)) {
    v.skip = SkipReason::nonfinite_grad;
  } else if (!std::isfinite(host[kAmaxSlot])) {
    v.skip = SkipReason::nonfinite_amax;
  } else if (guard_) {
    v.flags = guard_->observe(step, std::span(host).subspan(kGuardSlots));
    v.guard_z = guard_->max_z();
    if (guard_skips_ && !v.flags.empty()) v.skip = SkipReason::guard;
  }
  return v;
}

// ----------------------------------------------------------------------------
// SkipLog

SkipLog::SkipLog(int64_t max_skips, int64_t total, bool print)
    : max_skips_(max_skips), total_(total), print_(print) {
  OCTET_CHECK(max_skips >= 0, "--max-skips must be 0 (never stop) or positive, got ", max_skips);
}

void SkipLog::record(int64_t step, const StepVerdict& v, double loss,
                     std::vector<std::pair<std::string, MetricValue>>& fields) {
  in_a_row_ = v.skipped() ? in_a_row_ + 1 : 0;
  if (v.skipped()) {
    ++total_;
    last_ = v.skip;
    fields.emplace_back("skipped", true);
    fields.emplace_back("skip_reason", skip_reason_name(v.skip));
    fields.emplace_back("skips_total", total_);
  }
  if (v.guard_z) fields.emplace_back("guard_z", *v.guard_z);
  if (!v.flags.empty()) fields.emplace_back("guard", flags_json(v.flags));
  if (!print_) return;
  for (const GuardFlag& f : v.flags) std::printf("%s\n", describe_flag(f).c_str());
  if (v.skipped())
    std::printf("step %lld skipped: %s (loss %g, grad norm %g); %lld in a row, %lld in all\n",
                (long long)step, skip_reason_name(v.skip), loss, v.grad_norm, (long long)in_a_row_,
                (long long)total_);
  std::fflush(stdout);
}

std::string SkipLog::stop_message(int64_t step, const std::string& intact) const {
  std::ostringstream m;
  m << "training stopped at step " << step << ": " << in_a_row_
    << " steps in a row were skipped (--max-skips " << max_skips_ << "), the last for a "
    << skip_reason_name(last_) << ". Weights, optimizer and FP8 state are still those of step "
    << step - in_a_row_ << "; " << intact << ". Try a lower --lr, or look at the data after that "
    << "step";
  return m.str();
}

}  // namespace octet::train
