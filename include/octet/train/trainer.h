// The training loop behind `octet train`, and the checkpoint format it writes and resumes from.
#pragma once

#include <cstdint>
#include <string>

#include "octet/core/device.h"
#include "octet/train/config.h"
#include "octet/train/guard.h"

namespace octet::train {

/// Everything `octet train` takes. Zero / empty means "the default for the device".
struct TrainOptions {
  std::string device = "auto";  ///< cpu, cuda, cuda:N; auto = cuda when a GPU is visible
  std::string precision = "fp8-delayed";
  std::string model;  ///< preset; default tiny on CPU, gpt2-124m on GPU
  int64_t layers = 0, dim = 0, heads = 0, ffn = 0, vocab = 0;  ///< preset overrides
  std::string data = "builtin";
  int64_t steps = 0;
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t accum = 1;
  double lr = 0;        ///< peak learning rate
  int64_t warmup = -1;  ///< warmup steps; -1 = 5% of steps
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  uint64_t seed = 1337;
  bool recompute = false;
  bool deterministic = false;
  std::string out = "runs/latest";
  int64_t save_every = 0;  ///< 0: only at the end
  std::string resume;      ///< checkpoint path
  int64_t eval_every = 0;  ///< 0: only at the end
  int64_t eval_batches = 8;
  int64_t fp8_stats_every = 50;  ///< 0: never
  int64_t log_every = 10;        ///< plain progress lines when not on a terminal
  /// A step with a non-finite loss, gradient or FP8 amax is skipped (nothing it computed reaches
  /// the weights, the optimizer or the FP8 state); this many skipped steps in a row stop the run
  /// with an error, the last checkpoint intact. 0: never stop.
  int64_t max_skips = 10;
  /// The gradient-anomaly guard (guard.h): flags, in metrics.jsonl, a layer whose gradient norm
  /// leaves its running band; guard_skip also skips the flagged step (and implies guard).
  bool guard = false;
  bool guard_skip = false;
  double guard_z = GuardConfig{}.z;
  int64_t guard_warmup = GuardConfig{}.warmup;
  /// Testing aid: faults to inject on purpose (fault_injection.h), e.g. "nan-grad@5". "": none.
  std::string inject;
};

/// Resolves "auto"/defaults for the machine: device, model preset, steps, batch, seq, lr.
TrainOptions resolve_defaults(TrainOptions options);
/// Builds the model config from a preset plus overrides; `data_vocab` fills vocab when neither
/// the user nor a byte-level preset set it. Validates (throws octet::Error).
ModelConfig resolve_model_config(const TrainOptions& options, int data_vocab);

/// Runs training. Prints progress to stderr and a summary to stdout; writes metrics.jsonl,
/// loss.png (with gnuplot) and checkpoints under options.out. Throws octet::Error on bad input
/// (nothing written is lost: checkpoints are replaced atomically).
void run_train(const TrainOptions& options);

/// `octet bench train`: `warmup_steps` untimed steps, then options.steps timed ones; prints one
/// JSON line with the median tokens/s and the peak device memory of the run. With `profile`, the
/// timed steps also run under the op profiler (which adds a little overhead) and a table of the
/// device time per op and step goes to stderr.
void run_train_benchmark(const TrainOptions& options, int64_t warmup_steps, bool profile = false);

/// `octet eval`: val loss of a checkpoint (and arithmetic accuracy for the builtin corpus).
void run_eval(const std::string& checkpoint, const std::string& device, int64_t batches);
/// `octet generate`: samples `tokens` tokens after `prompt` (byte-level vocabularies).
void run_generate(const std::string& checkpoint, const std::string& device,
                  const std::string& prompt, int64_t tokens, double temperature, uint64_t seed);
/// `octet inspect`: the config and a table of the FP8 state per layer.
void run_inspect(const std::string& checkpoint);

}  // namespace octet::train
