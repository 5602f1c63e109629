#include "octet/nn/fp8_state.h"

#include <algorithm>

#include "octet/core/carve.h"
#include "octet/fp8/format.h"
#include "octet/ops/quantize.h"

namespace octet::nn {
namespace {

/// Roles per pass, in slot order.
constexpr int kRoles[2] = {fp8::kForwardRoles, fp8::kBackwardRoles};
/// Pass-representative role, for the pass's FP8 format.
constexpr fp8::TensorRole kFormatRole[2] = {fp8::TensorRole::input, fp8::TensorRole::grad_output};

Tensor filled(int64_t n, float value, const Device& device) {
  return Tensor::from_vector(std::vector<float>(static_cast<size_t>(n), value), {n}).to(device);
}

/// Row 0 of a history [len, n] as an f32[n] view.
Tensor history_row0(const ops::ScalingGroup& group) {
  return group.amax_history.slice(0, 1).view({group.amax_history.size(1)});
}

}  // namespace

// ----------------------------------------------------------------------------
// FP8State

FP8State::FP8State(const fp8::Recipe& recipe, const Device& device)
    : recipe_(recipe), device_(device) {
  recipe.validate();
  check_device_available(device);
  const int64_t history_len = recipe.kind == fp8::RecipeKind::delayed ? recipe.amax_history_len : 1;
  for (int p = 0; p < 2; ++p) {
    const int64_t n = kRoles[p];
    ops::ScalingGroup& group = groups_[p];
    group.amax_history = Tensor::zeros({history_len, n}, DType::f32, device);
    group.scale = filled(n, 1.0f, device);
    group.scale_inv = filled(n, 1.0f, device);
    group.fp8_max = fp8::fp8_max(recipe.dtype_for(kFormatRole[p]));
    last_amax_[p] = Tensor::zeros({n}, DType::f32, device);
  }
}

bool FP8State::matches(const fp8::Recipe& r) const {
  return r.kind == recipe_.kind && r.format == recipe_.format && r.margin == recipe_.margin &&
         r.amax_history_len == recipe_.amax_history_len &&
         r.amax_compute_algo == recipe_.amax_compute_algo &&
         r.power_of_2_scales == recipe_.power_of_2_scales;
}

const ops::ScalingGroup& FP8State::group(Pass pass) const { return groups_[index(pass)]; }

Tensor FP8State::scale(fp8::TensorRole role) const {
  const int slot = fp8::role_slot(role);
  return group(pass_of(role)).scale.slice(slot, slot + 1);
}

Tensor FP8State::amax_slot(fp8::TensorRole role) const {
  const int slot = fp8::role_slot(role);
  return group(pass_of(role)).amax_history.view({-1}).slice(slot, slot + 1);
}

const Tensor& FP8State::last_amax(Pass pass) const { return last_amax_[index(pass)]; }

Tensor FP8State::last_amax(fp8::TensorRole role) const {
  const int slot = fp8::role_slot(role);
  return last_amax(pass_of(role)).slice(slot, slot + 1);
}

void FP8State::finish_update(Pass pass) {
  pending_[index(pass)] = false;
  calibrated_[index(pass)] = true;
  ++updates_[index(pass)];
}

// ----------------------------------------------------------------------------
// AmaxRegistry

AmaxRegistry::AmaxRegistry(std::shared_ptr<AmaxReducer> reducer) : reducer_(std::move(reducer)) {}

void AmaxRegistry::prune() {
  std::erase_if(order_, [](const Entry& e) { return e.state.expired(); });
}

void AmaxRegistry::register_state(const std::shared_ptr<FP8State>& state) {
  OCTET_CHECK(state != nullptr, "AmaxRegistry::register_state: received a null state");
  prune();  // before the lookup: a dead state's address may have been reused
  if (contains(state.get())) return;
  order_.push_back({state.get(), state});
}

void AmaxRegistry::unregister_state(const FP8State* state) {
  std::erase_if(order_, [&](const Entry& e) { return e.address == state || e.state.expired(); });
}

bool AmaxRegistry::contains(const FP8State* state) const {
  return std::any_of(order_.begin(), order_.end(),
                     [&](const Entry& e) { return e.address == state && !e.state.expired(); });
}

std::vector<std::shared_ptr<FP8State>> AmaxRegistry::states() const {
  std::vector<std::shared_ptr<FP8State>> live;
  for (const Entry& e : order_) {
    if (auto s = e.state.lock()) live.push_back(std::move(s));
  }
  return live;
}

void AmaxRegistry::finalize(Pass pass) {
  const int p = pass == Pass::forward ? 0 : 1;
  ++update_count_[p];
  prune();
  std::vector<std::shared_ptr<FP8State>> pending;
  if (reducer_) {
    // The group agrees on the pass's pending states: a module that ran on some ranks only (an MoE
    // expert that got no rows on the others) is finalized on every rank, from the MAX of its row
    // 0, which a rank that did not run it holds as zeros or as the weight amax the (identical)
    // optimizer step recorded. One reduction, registration order: every registered state's row
    // 0, then a pending flag per state.
    const std::vector<std::shared_ptr<FP8State>> registered = states();
    if (registered.empty()) return;
    Tensor flags = Tensor::zeros({static_cast<int64_t>(registered.size())}, DType::f32);
    std::vector<Tensor> rows;
    rows.reserve(registered.size() + 1);
    for (size_t k = 0; k < registered.size(); ++k) {
      rows.push_back(history_row0(registered[k]->groups_[p]));
      if (registered[k]->pending(pass)) flags.data<float>()[k] = 1.0f;
    }
    rows.push_back(flags);
    reducer_->all_reduce_max(rows);
    for (size_t k = 0; k < registered.size(); ++k) {
      if (flags.data<float>()[k] == 0.0f) continue;
      registered[k]->mark_recorded(pass);
      pending.push_back(registered[k]);
    }
  } else {
    for (auto& s : states())
      if (s->pending(pass)) pending.push_back(std::move(s));
  }
  if (pending.empty()) return;

  // One update per (device, margin, algo), states in registration order: ops run on the device
  // of their tensors, so states on different GPUs are never mixed in one call. The update keeps
  // row 0 in last_amax (statistics) before it rolls the history.
  struct Bucket {
    Device device;
    int margin;
    fp8::AmaxAlgo algo;
    std::vector<ops::ScalingGroup> groups;
    std::vector<FP8State*> states;
  };
  std::vector<Bucket> buckets;
  for (const auto& s : pending) {
    const fp8::Recipe& r = s->recipe();
    if (r.kind != fp8::RecipeKind::delayed) {
      // No scale to roll: row 0 only served statistics.
      ops::cast(history_row0(s->groups_[p]), s->last_amax_[p]);
      history_row0(s->groups_[p]).zero();
      continue;
    }
    auto it = std::find_if(buckets.begin(), buckets.end(), [&](const Bucket& b) {
      return b.device == s->device() && b.margin == r.margin && b.algo == r.amax_compute_algo;
    });
    if (it == buckets.end()) {
      buckets.push_back({s->device(), r.margin, r.amax_compute_algo, {}, {}});
      it = buckets.end() - 1;
    }
    ops::ScalingGroup group = s->groups_[p];
    group.last_amax = s->last_amax_[p];
    it->groups.push_back(std::move(group));
    it->states.push_back(s.get());
  }
  for (Bucket& b : buckets) {
    // Forward scales are snapshotted by Linear forwards for recompute (Linear::Snapshot): the new
    // scales go to fresh storage, so a snapshot keeps the values it was taken with. One
    // allocation serves the bucket's states (a slice each): an MoE layer's experts are many
    // states, and an allocation each would cost host time on every step.
    if (pass == Pass::forward) {
      TensorCarver next(b.device, sizeof(float));
      for (ops::ScalingGroup& g : b.groups) next.place(g.scale.shape(), DType::f32, &g.next_scale);
      next.allocate();
    }
    ops::update_delayed_scaling(b.groups.data(), static_cast<int>(b.groups.size()), b.margin,
                                b.algo);
    ++scaling_update_calls_;
    for (size_t i = 0; i < b.states.size(); ++i) {
      if (b.groups[i].next_scale.defined()) b.states[i]->groups_[p].scale = b.groups[i].next_scale;
    }
  }
  for (const auto& s : pending) s->finish_update(pass);
}

}  // namespace octet::nn
