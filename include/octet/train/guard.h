// The gradient-anomaly guard of `octet train --guard`: a running band per layer group and
// microbatch of the gradient norm, and a z-score test against it (in the spirit of llm.c's
// z-score update skip). Host arithmetic only: the trainer measures the norms on the device
// (ops::global_norm_squared, fixed order) and hands them over once per step.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace octet::train {

/// Settings of the guard. The defaults are argued in docs/RELIABILITY.md ("Non-finite steps and
/// the gradient guard"): over 5 normal 300-step runs of the tiny model (15,400 tests) the largest
/// z was 4.96, while one layer's gradient scaled by 1e4 scores 17 at step 50 and about 35 later.
struct GuardConfig {
  /// A norm is flagged when (log(norm) - band mean) / band std exceeds this (one-sided: a norm
  /// that falls is never harmful to the weights). Above llm.c's usual 5 because every layer and
  /// microbatch is tested (up to 1,000 tests a step), not one global norm.
  double z = 8.0;
  /// Observations per band before it can flag: the band is then the exact mean and variance of
  /// these (Welford), not an exponential average of too few samples.
  int64_t warmup = 20;
  /// Weight of a new observation in the exponential moving mean and variance after warm-up
  /// (a memory of about 1/decay = 20 steps, so the band follows the norms' slow drift).
  double decay = 0.05;
  /// Smallest band std, in natural-log units (5% relative): a band that has seen nearly
  /// constant norms does not flag a change of a few percent.
  double min_std = 0.05;
};

/// One flagged observation: layer group `layer`'s accumulated gradient norm after `microbatch`
/// (0-based) left its band at `step`.
struct GuardFlag {
  int64_t step = 0;
  std::string layer;
  int64_t microbatch = 0;
  double z = 0;
  double norm = 0;
  /// The band it was tested against, back in norm units: exp(mean) and the std in log units.
  double band_norm = 0;
  double band_std = 0;
};

/// Running bands of log gradient norms, one per (layer group, microbatch index) slot. The norm of
/// a group after microbatch m is the norm of its accumulated gradient so far, which grows with m;
/// each m gets its own band, so a corruption that enters at microbatch k flags slots k and on,
/// and the guard reports k.
///
/// A flagged observation still updates its band, clipped (winsorized) to the band's edge
/// (mean + z * std): one spike barely moves the band, while a lasting change of level widens and
/// moves it within a few steps instead of being flagged forever.
class GradientGuard {
 public:
  /// `layers`: names of the groups; `microbatches`: observations per group per step.
  GradientGuard(std::vector<std::string> layers, int64_t microbatches, GuardConfig config = {});

  /// Observes one step: norm_sq[m * layers + g] is the squared norm of group g's gradient
  /// accumulated up to microbatch m. Returns the flags, at most one per group (its first flagged
  /// microbatch, with that slot's z). Non-finite or zero norms are neither tested nor learned
  /// (non-finite steps are skipped by the trainer before their norms could matter).
  std::vector<GuardFlag> observe(int64_t step, std::span<const float> norm_sq);

  /// The largest z of the last observe() over every slot past its warm-up (0 before any).
  double max_z() const { return max_z_; }
  const std::vector<std::string>& layers() const { return layers_; }
  int64_t microbatches() const { return microbatches_; }
  const GuardConfig& config() const { return config_; }

 private:
  struct Band {
    int64_t samples = 0;
    double mean = 0;
    double var = 0;  ///< Welford's M2 / samples during warm-up, the moving variance after
  };
  /// Tests `x` (log norm) against `band`; returns its z (0 while warming up) and learns it.
  double test_and_learn(Band& band, double x) const;

  std::vector<std::string> layers_;
  int64_t microbatches_;
  GuardConfig config_;
  std::vector<Band> bands_;  ///< [microbatches][layers]
  double max_z_ = 0;
};

/// The layer group of a parameter name, the unit the guard watches: "blocks.L" for everything of
/// transformer block L, otherwise the name's first component ("wte", "wpe", "final_norm",
/// "lm_head").
std::string layer_group(const std::string& parameter_name);

}  // namespace octet::train
