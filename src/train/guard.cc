#include "octet/train/guard.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "octet/core/error.h"

namespace octet::train {

GradientGuard::GradientGuard(std::vector<std::string> layers, int64_t microbatches,
                             GuardConfig config)
    : layers_(std::move(layers)), microbatches_(microbatches), config_(config) {
  OCTET_CHECK(!layers_.empty() && microbatches_ >= 1,
              "GradientGuard: expected at least one layer group and one microbatch, got ",
              layers_.size(), " and ", microbatches_);
  OCTET_CHECK(config_.z > 0 && std::isfinite(config_.z), "--guard-z must be positive, got ",
              config_.z);
  OCTET_CHECK(config_.warmup >= 2, "--guard-warmup must be at least 2 (a band needs a spread), ",
              "got ", config_.warmup);
  OCTET_CHECK(config_.decay > 0 && config_.decay <= 1 && config_.min_std >= 0,
              "GradientGuard: expected decay in (0, 1] and min_std >= 0, got ", config_.decay,
              " and ", config_.min_std);
  bands_.resize(layers_.size() * static_cast<size_t>(microbatches_));
}

double GradientGuard::test_and_learn(Band& b, double x) const {
  if (b.samples < config_.warmup) {
    // Welford's update of the exact mean and (population) variance of the samples so far.
    ++b.samples;
    const double d = x - b.mean;
    b.mean += d / static_cast<double>(b.samples);
    b.var += (d * (x - b.mean) - b.var) / static_cast<double>(b.samples);
    return 0.0;
  }
  const double std = std::max(std::sqrt(b.var), config_.min_std);
  const double z = (x - b.mean) / std;
  // Learn the value clipped to the band's edges: bounded influence for a single outlier.
  const double edge = config_.z * std;
  const double d = std::clamp(x, b.mean - edge, b.mean + edge) - b.mean;
  b.mean += config_.decay * d;
  b.var = (1.0 - config_.decay) * (b.var + config_.decay * d * d);
  ++b.samples;
  return z;
}

std::vector<GuardFlag> GradientGuard::observe(int64_t step, std::span<const float> norm_sq) {
  const size_t groups = layers_.size();
  OCTET_CHECK(norm_sq.size() == bands_.size(), "GradientGuard::observe: expected ", bands_.size(),
              " squared norms (", microbatches_, " microbatches x ", groups, " groups), got ",
              norm_sq.size());
  std::vector<GuardFlag> flags;
  max_z_ = 0;
  for (size_t g = 0; g < groups; ++g) {
    bool flagged = false;
    for (int64_t m = 0; m < microbatches_; ++m) {
      const size_t slot = static_cast<size_t>(m) * groups + g;
      const double value = norm_sq[slot];
      if (!std::isfinite(value) || value <= 0) continue;
      const double norm = std::sqrt(value);
      Band& band = bands_[slot];
      const Band before = band;
      const double z = test_and_learn(band, std::log(norm));
      max_z_ = std::max(max_z_, z);
      if (flagged || z <= config_.z) continue;
      flagged = true;
      flags.push_back({step, layers_[g], m, z, norm, std::exp(before.mean),
                       std::max(std::sqrt(before.var), config_.min_std)});
    }
  }
  return flags;
}

std::string layer_group(const std::string& name) {
  const size_t first = name.find('.');
  if (first == std::string::npos) return name;
  if (name.compare(0, first, "blocks") != 0) return name.substr(0, first);
  const size_t second = name.find('.', first + 1);
  return second == std::string::npos ? name : name.substr(0, second);
}

}  // namespace octet::train
