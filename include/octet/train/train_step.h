// One optimizer step of `octet train` (src/train/trainer.cc), public so that tests can drive the
// same step the command runs, e.g. a data-parallel run against one process (tests/dist).
#pragma once

#include "octet/train/checkpoint.h"
#include "octet/train/data.h"
#include "octet/train/data_parallel.h"
#include "octet/train/step_checks.h"
#include "octet/train/trainer.h"

namespace octet::train {

struct StepResult {
  double loss = 0, lr = 0;  ///< the step's mean loss (over every rank's microbatches), its lr
  StepVerdict verdict;      ///< the grad norm, whether the step was skipped, the guard's flags
};

/// One optimizer step: `accum` microbatches, the checks, AdamW with clipping. A step that fails
/// the checks (a non-finite loss, gradient norm or amax; the guard, when it skips) is skipped:
/// AdamW does not run, so weights and moments stay as they were, and the FP8 state goes back to
/// its snapshot from before the step. Under data parallelism (`dp` active) this rank computes its
/// share of the microbatches, and the gradients, the loss and the verdict are reduced over the
/// ranks (data_parallel.h); s.model must then have been built with dp.amax_reducer().
StepResult train_step(TrainState& s, TokenSource& data, const TrainOptions& o, StepChecks& checks,
                      DataParallel& dp);

}  // namespace octet::train
