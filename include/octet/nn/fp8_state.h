// FP8 state of a module (scales and amax history on the module's device) and the registry that
// finalizes the amaxes of all registered modules once per pass (DESIGN.md rules 1 and 2).
//
// These live in the nn layer, not in fp8, because finalizing calls ops::update_delayed_scaling.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "octet/core/tensor.h"
#include "octet/fp8/recipe.h"
#include "octet/ops/scaling.h"

namespace octet::nn {

/// The two passes whose tensors are finalized separately: forward (input, weight) after each
/// forward pass, backward (grad_output) after each backward pass.
enum class Pass : uint8_t { forward, backward };

/// Which pass a role belongs to.
constexpr Pass pass_of(fp8::TensorRole role) {
  return fp8::is_forward_role(role) ? Pass::forward : Pass::backward;
}

/// Scales and amax history of one module, on the module's device (never an ambient device).
///
/// Forward group: roles input and weight, history [len, 2]; backward group: grad_output,
/// history [len, 1]. Scales start at 1 and histories at 0. len is the recipe's amax_history_len
/// for delayed scaling; the other recipes have no scale to roll but keep one amax row per pass
/// for statistics (len 1).
class FP8State {
 public:
  FP8State(const fp8::Recipe& recipe, const Device& device);
  FP8State(const FP8State&) = delete;
  FP8State& operator=(const FP8State&) = delete;

  const fp8::Recipe& recipe() const { return recipe_; }
  const Device& device() const { return device_; }
  /// True when this state was built for a recipe with the same fields (modules build a new state
  /// when the active recipe differs).
  bool matches(const fp8::Recipe& recipe) const;

  /// The scaling group of a pass (what ops::update_delayed_scaling updates).
  const ops::ScalingGroup& group(Pass pass) const;
  /// The scale of a role: an f32[1] view into its group's scale tensor. A delayed update writes
  /// the forward roles' new scales to fresh storage (copy-on-write), so a view of an input or
  /// weight scale keeps the value it had when it was taken; grad_output's is updated in place.
  Tensor scale(fp8::TensorRole role) const;
  /// The amax slot of a role: an f32[1] view of its element in history row 0, where a cast of
  /// the pass in flight records its amax.
  Tensor amax_slot(fp8::TensorRole role) const;
  /// Row 0 of the history of a pass as it was at the last finalize (f32[n]): statistics.
  const Tensor& last_amax(Pass pass) const;
  /// The amax of a role at the last finalize (f32[1] view of last_amax).
  Tensor last_amax(fp8::TensorRole role) const;

  /// Marks that a cast of `pass` recorded into this state since the last finalize. Finalize
  /// updates only states that took part in the pass.
  void mark_recorded(Pass pass) { pending_[index(pass)] = true; }
  bool pending(Pass pass) const { return pending_[index(pass)]; }

  /// True once `pass` has amaxes in its history: a finalize updated it, or a checkpoint or snapshot
  /// restored one that had. Before that, delayed scaling has no amax to take a scale from, and
  /// Linear takes the pass's first scales from the tensors themselves (current scaling) rather
  /// than the initial 1, which would flush most of a first step's gradients to zero.
  bool calibrated(Pass pass) const { return calibrated_[index(pass)]; }
  void set_calibrated(Pass pass, bool calibrated) { calibrated_[index(pass)] = calibrated; }

  /// Updates applied to this state by finalize, per pass.
  int64_t forward_updates() const { return updates_[0]; }
  int64_t backward_updates() const { return updates_[1]; }

 private:
  friend class AmaxRegistry;
  static constexpr int index(Pass pass) { return pass == Pass::forward ? 0 : 1; }
  /// Called by the registry after it finalized `pass` for this state.
  void finish_update(Pass pass);

  fp8::Recipe recipe_;
  Device device_;
  ops::ScalingGroup groups_[2];
  Tensor last_amax_[2];
  bool pending_[2] = {false, false};
  int64_t updates_[2] = {0, 0};
  bool calibrated_[2] = {false, false};
};

/// Extension point for distributed amax reduction (the dist layer implements it; nn stays free
/// of MPI/NCCL). One registry serves one reduction group (e.g. the tensor-parallel group), so a
/// model holds one registry per group, each with its own reducer.
class AmaxReducer {
 public:
  virtual ~AmaxReducer() = default;
  /// Replaces every element of `amax_rows` (history row 0 of each registered state, then one
  /// pending flag per state; f32, possibly on several devices) by its MAX over the group. The
  /// rows come in registration order, which must be the same on every rank: gather them in that
  /// order, reduce once, scatter back.
  virtual void all_reduce_max(std::span<const Tensor> amax_rows) = 0;
};

/// The FP8 states of a model, in registration order. finalize_forward() / finalize_backward()
/// run once per pass: they group the pending states by device (keeping registration order) and,
/// for delayed scaling, roll each device's histories and update its scales with one
/// ops::update_delayed_scaling call. For the other recipes there is no scale to roll; the call
/// still counts as the pass's update, copies row 0 into last_amax and zeroes it.
///
/// The registry holds weak references: a destroyed module drops out by itself.
class AmaxRegistry {
 public:
  /// `reducer`: optional all-reduce of the amaxes over this registry's group (none: local).
  explicit AmaxRegistry(std::shared_ptr<AmaxReducer> reducer = nullptr);

  /// Adds a state at the end of the order; a state already registered keeps its place.
  void register_state(const std::shared_ptr<FP8State>& state);
  /// Removes a state (no-op when it is not registered).
  void unregister_state(const FP8State* state);
  /// Live registered states, in registration order.
  std::vector<std::shared_ptr<FP8State>> states() const;
  /// True when `state` is registered and alive.
  bool contains(const FP8State* state) const;

  /// Finalizes the forward (input, weight) amaxes of the pass that just ended.
  void finalize_forward() { finalize(Pass::forward); }
  /// Finalizes the backward (grad_output) amaxes of the pass that just ended.
  void finalize_backward() { finalize(Pass::backward); }

  /// finalize_forward() / finalize_backward() calls so far (each counts, pending states or not).
  int64_t forward_update_count() const { return update_count_[0]; }
  int64_t backward_update_count() const { return update_count_[1]; }
  /// ops::update_delayed_scaling calls so far (one per device per delayed pass).
  int64_t scaling_update_calls() const { return scaling_update_calls_; }

 private:
  void finalize(Pass pass);
  /// Drops entries whose state was destroyed.
  void prune();

  struct Entry {
    const FP8State* address;  ///< identity while `state` is alive
    std::weak_ptr<FP8State> state;
  };
  std::shared_ptr<AmaxReducer> reducer_;
  std::vector<Entry> order_;
  int64_t update_count_[2] = {0, 0};
  int64_t scaling_update_calls_ = 0;
};

}  // namespace octet::nn
