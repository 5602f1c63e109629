// The learning-rate schedule of `octet train` and its defaults.
#pragma once

#include <cstdint>

namespace octet::train {

/// Learning rate at 1-based `step`: linear warmup to `peak`, then inverse-square-root decay.
/// The schedule has no horizon, so it does not depend on --steps: a run resumed with more steps
/// continues exactly as an uninterrupted one.
double learning_rate(double peak, int64_t warmup, int64_t step);

/// The default peak learning rate of a model `dim` wide: the GPT-3 paper's per-size table
/// (Brown et al. 2020, table 2.1: 6e-4 at width 768 down to 0.6e-4 at 12288), extended below
/// 768 by octet's tiny CPU model (2e-3 at width 128), interpolated linearly in log(lr) over
/// log(width) between rows and held constant beyond the first and last.
double default_learning_rate(int64_t dim);

/// Warmup steps when --warmup is not given, by the model's width: 20 at octet's tiny model (width
/// 128), 200 from GPT-2 124M (768) up, interpolated like the learning rate. A property of the
/// model, not a share of --steps, so that a run continued for more steps keeps its schedule.
int64_t default_warmup(int64_t dim);

}  // namespace octet::train
