// What the data-parallel tests share: the tiny model's options, a few training steps on a world
// (the step `octet train` runs), and comparisons of the trained state across runs and ranks.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "octet/core/hash.h"
#include "octet/dist/communicator.h"
#include "octet/train/train_step.h"
#include "octet/train/zero.h"
#include "test_util.h"

namespace octet::train {

inline constexpr int64_t kSteps = 4;
inline constexpr int64_t kMicrobatchesPerRank = 2;

/// The tiny model's options for `world_size` ranks, drawing weights and data from `seed`.
inline TrainOptions tiny_options(const std::string& precision, int world_size, uint64_t seed) {
  TrainOptions o;
  o.device = "cpu";
  o.precision = precision;
  o.model = "tiny";
  o.layers = 2;
  o.dim = 32;
  o.heads = 2;
  o.ffn = 64;
  o.steps = kSteps;
  o.batch = 2;
  o.seq = 16;  // batch*seq = 32, a multiple of the FP8 GEMMs' 16
  o.accum = kMicrobatchesPerRank * world_size;
  o.lr = 3e-3;
  o.warmup = 2;
  o.seed = seed;
  return resolve_defaults(o);
}

/// The data and the train state of a run of `o` on `dp`'s world, the model on `device`.
struct RunStart {
  std::unique_ptr<TokenSource> data;
  TrainState state;
};
inline RunStart start_run(const TrainOptions& o, DataParallel& dp,
                          const Device& device = Device::cpu()) {
  RunStart start;
  start.data = make_token_source("builtin", o.seed);
  const ModelConfig config = resolve_model_config(o, start.data->vocab_size());
  start.state = make_train_state(config, Precision::from_name(o.precision), device, o.seed, false,
                                 dp.amax_reducer());
  return start;
}

struct TrainedRun {
  std::vector<double> losses;
  std::vector<std::pair<std::string, Tensor>> tensors;  ///< checkpoint_tensors: all state
  /// FP8 runs: the statistics of the last step (under ZeRO with the weights' shared).
  std::vector<Fp8LayerStats> fp8_stats;
  int64_t skipped = 0;  ///< steps skipped (an injected fault)
  TrainState state;     ///< keeps the tensors' model alive
};

/// o.steps steps of `o` on `dp`'s world (a single process when dp is inactive), with the AdamW
/// moments and masters sharded over it when o.zero is 1 (gathered whole again into `tensors`), the
/// model on `device` (the NCCL tests': the rank's GPU).
inline TrainedRun train_run(const TrainOptions& o, DataParallel& dp,
                            const Device& device = Device::cpu()) {
  TrainedRun run;
  RunStart start = start_run(o, dp, device);
  const std::unique_ptr<TokenSource> data = std::move(start.data);
  run.state = std::move(start.state);
  const Precision precision = run.state.model->precision();
  if (o.zero == 1)
    run.state.zero = std::make_shared<ZeroOptimizer>(dp.communicator(), run.state, o.weight_decay);
  StepChecks checks(*run.state.model, run.state.params, o);
  const bool fp8 = precision.kind == Precision::Kind::fp8;
  for (int64_t i = 0; i < o.steps; ++i) {
    run.state.model->set_collect_fp8_stats(fp8 && i + 1 == o.steps);
    const StepResult r = train_step(run.state, *data, o, checks, dp);
    if (o.inject.empty()) EXPECT_FALSE(r.verdict.skipped()) << "step " << i + 1;
    run.skipped += r.verdict.skipped() ? 1 : 0;
    run.losses.push_back(r.loss);
  }
  if (fp8) {
    run.fp8_stats = run.state.model->fp8_layer_stats();
    if (run.state.zero)
      run.fp8_stats = run.state.zero->share_weight_stats(run.state, std::move(run.fp8_stats));
  }
  if (run.state.zero) run.state.zero->gather(run.state);
  run.tensors = checkpoint_tensors(run.state);
  return run;
}

inline bool is_fp8_state(const std::string& name) { return name.rfind("fp8.", 0) == 0; }

/// FNV-1a of the bytes of the FP8 state's tensors (`fp8`) or of all the others, in checkpoint
/// order.
inline uint64_t hash_of(const std::vector<std::pair<std::string, Tensor>>& tensors, bool fp8) {
  uint64_t h = kFnv1aBasis;
  for (const auto& [name, t] : tensors)
    if (is_fp8_state(name) == fp8) h = fnv1a(t.raw_data(), t.nbytes(), h);
  return h;
}

/// Whether `value` is the same on every rank of `comm`.
inline bool same_on_every_rank(dist::Communicator& comm, uint64_t value) {
  Tensor root = Tensor::empty({1}, DType::i64);
  *root.data<int64_t>() = static_cast<int64_t>(value);
  comm.broadcast(std::span(&root, 1), 0);
  Tensor differs =
      Tensor::from_vector({static_cast<uint64_t>(*root.data<int64_t>()) == value ? 0.f : 1.f}, {1});
  comm.all_reduce(std::span(&differs, 1), dist::ReduceOp::max);
  return testing::to_floats(differs)[0] == 0.0f;
}

/// Every parameter ("param." tensors) of a run, joined in checkpoint order.
inline std::vector<float> all_params(const TrainedRun& run) {
  std::vector<float> out;
  for (const auto& [name, t] : run.tensors) {
    if (name.rfind("param.", 0) != 0) continue;
    const std::vector<float> values = testing::to_floats(t);
    out.insert(out.end(), values.begin(), values.end());
  }
  return out;
}

/// ||a - b|| / ||b|| over every parameter together.
inline double param_relative_l2(const TrainedRun& a, const TrainedRun& b) {
  return testing::relative_l2(all_params(a), all_params(b));
}

}  // namespace octet::train
