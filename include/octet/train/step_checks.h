// What `octet train` checks around every optimizer step before the step may touch the weights:
// a non-finite loss, gradient norm or FP8 amax skips the step (the FP8 state goes back to its
// snapshot from before the step, AdamW does not run), and the gradient guard flags (and
// optionally skips) steps whose per-layer gradient norms leave their band.
// docs/RELIABILITY.md ("Non-finite steps and the gradient guard") has the contract.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "octet/core/tensor.h"
#include "octet/nn/fp8_state.h"
#include "octet/train/fault_injection.h"
#include "octet/train/guard.h"
#include "octet/train/metrics.h"

namespace octet::train {

class GPT;
struct Parameter;
struct TrainOptions;

/// Why a step was skipped (none: it was applied).
enum class SkipReason : uint8_t { none, nonfinite_loss, nonfinite_grad, nonfinite_amax, guard };
/// "non-finite loss", "non-finite gradient", "non-finite amax", "gradient guard".
const char* skip_reason_name(SkipReason reason);

/// The FP8 state of a set of modules that the next steps compute with (scale, scale_inv and amax
/// history of both passes), copied on each state's own device by one stream-ordered
/// ops::copy_tensors launch per device for all states (no host sync), so a skipped step can put
/// every byte back. Each state's last amax (statistics of the
/// last pass, FP8State::last_amax) is not kept: after a skip it reports the skipped pass, which
/// is what that step's metrics should show, and the next pass overwrites it whole.
class Fp8Snapshot {
 public:
  /// Copies the states now (the copy buffers are allocated by the first capture and reused).
  void capture(const std::vector<std::shared_ptr<nn::FP8State>>& states);
  /// Writes the captured bytes back into the same states: into the tensors they hold now (a
  /// forward update moves a scale to fresh storage, so the tensors may differ from those read).
  void restore() const;
  bool empty() const { return entries_.empty(); }

 private:
  struct Entry {
    std::shared_ptr<nn::FP8State> state;
    std::vector<Tensor> copies;
    bool calibrated[2] = {false, false};  ///< FP8State::calibrated per pass, forward first
  };
  std::vector<Entry> entries_;
};

/// The tensors of a state that Fp8Snapshot copies, in a fixed order.
std::vector<Tensor> fp8_state_tensors(const nn::FP8State& state);

/// The guard's flags as metrics JSON: [{"layer", "microbatch", "z", "norm", "band_norm"}, ...].
nlohmann::json flags_json(const std::vector<GuardFlag>& flags);
/// One log line for a flag: "step 12: gradient guard: blocks.1 at microbatch 0, norm ... ".
std::string describe_flag(const GuardFlag& flag);

/// The verdict on one step.
struct StepVerdict {
  SkipReason skip = SkipReason::none;
  bool skipped() const { return skip != SkipReason::none; }
  double grad_norm = 0;          ///< the global gradient norm (NaN/inf when not finite)
  std::vector<GuardFlag> flags;  ///< the guard's flags (also when the step is not skipped)
  /// With the guard on and the step's norms finite: the largest z of any layer and microbatch
  /// (0 while the bands warm up), how close the step came to being flagged.
  std::optional<double> guard_z;
};

/// Per-run state of the checks; one per training run, driven by train_step:
///   begin_step; per microbatch: before_microbatch, train_microbatch, after_microbatch;
///   settle_grads; finish -> verdict; then either AdamW with norm_sq() or restore_fp8().
/// The global norm, the amax check and the guard's per-layer norms go to one device buffer,
/// read by the step's single host sync in finish().
class StepChecks {
 public:
  StepChecks(GPT& model, const std::vector<Parameter>& params, const TrainOptions& options);
  ~StepChecks();

  /// Before the first microbatch: snapshots the FP8 state.
  void begin_step(int64_t step);
  /// Fault injection (testing aid) before microbatch `micro`'s forward.
  void before_microbatch(int64_t step, int64_t micro);
  /// After its backward: fault injection, then the guard's per-layer norms of the gradients
  /// accumulated so far (the gradients must be settled: see GPT::settle_grads).
  void after_microbatch(int64_t step, int64_t micro);
  /// After the last microbatch, with settled gradients and the step's mean `loss`.
  StepVerdict finish(int64_t step, double loss);
  /// The squared global gradient norm on the model's device (f32[1]), for AdamW's clipping.
  const Tensor& norm_sq() const { return norm_sq_; }
  /// Puts the FP8 state back as it was at begin_step.
  void restore_fp8() const { snapshot_.restore(); }
  /// Whether after_microbatch measures norms (the guard is on).
  bool guarding() const { return guard_.has_value(); }

 private:
  GPT& model_;
  const std::vector<Parameter>& params_;
  std::vector<Tensor> grads_;
  /// The gradients of each layer group (GradientGuard::layers() order), in parameters() order.
  std::vector<std::vector<Tensor>> group_grads_;
  bool guard_skips_ = false;
  std::optional<GradientGuard> guard_;
  FaultInjector injector_;
  Fp8Snapshot snapshot_;
  /// f32 [2 + microbatches * groups] on the model's device: the global norm squared, the amax
  /// check (sum of squares of every amax: non-finite iff one is, or one exceeds ~1.8e19), then
  /// the guard's squared norms; norm_sq_ views slot 0.
  Tensor buffer_;
  Tensor norm_sq_;
};

/// The skipped steps of a run, for metrics.jsonl, the log and --max-skips.
class SkipLog {
 public:
  /// `max_skips`: skipped steps in a row that stop the run (0: never); `total`: skips so far (a
  /// resumed run's metrics hold its earlier ones); `print`: false keeps record() silent (the
  /// data-parallel ranks other than 0).
  SkipLog(int64_t max_skips, int64_t total, bool print = true);
  /// Counts `step`'s verdict; adds "skipped", "skip_reason" and "skips_total" to `fields` when it
  /// was skipped, "guard_z" when the guard measured it and "guard" when the guard flagged it, and
  /// prints one stdout line per skip and per flag.
  void record(int64_t step, const StepVerdict& verdict, double loss,
              std::vector<std::pair<std::string, MetricValue>>& fields);
  /// True when the last max_skips steps were all skipped.
  bool exhausted() const { return max_skips_ > 0 && in_a_row_ >= max_skips_; }
  /// Why the run stops at `step`; `intact` says which checkpoint is left as it was.
  std::string stop_message(int64_t step, const std::string& intact) const;
  int64_t total() const { return total_; }

 private:
  int64_t max_skips_, total_, in_a_row_ = 0;
  bool print_ = true;
  SkipReason last_ = SkipReason::none;
};

}  // namespace octet::train
