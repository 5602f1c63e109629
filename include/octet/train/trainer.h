// The training loop behind `octet train` and `octet bench train`, and their options.
#pragma once

#include <cstdint>
#include <string>

#include "octet/core/device.h"
#include "octet/train/config.h"
#include "octet/train/guard.h"

namespace octet::train {

/// FP8 GEMM dimensions (tokens too) must be multiples of this (the cuBLASLt rule).
inline constexpr int64_t kTokenMultiple = 16;
/// The default of `octet train --keep`: the newest checkpoint and the one before it.
inline constexpr int64_t kDefaultKeep = 2;

/// Everything `octet train` takes. Zero / empty means "the default for the device".
struct TrainOptions {
  std::string device = "auto";  ///< cpu, cuda, cuda:N; auto = cuda when a GPU is visible
  std::string precision = "fp8-delayed";
  /// The FP8 recipe's knobs under Transformer Engine's DelayedScaling names (0, -1 or empty: the
  /// recipe's default). amax_history, amax_algo and margin are delayed scaling's; fp8_format
  /// applies to fp8-delayed and fp8-current.
  int64_t amax_history = 0;  ///< amax_history_len
  std::string amax_algo;     ///< amax_compute_algo: max or most_recent
  int64_t margin = -1;       ///< margin: scales are divided by 2^margin
  std::string fp8_format;    ///< fp8_format: hybrid (E4M3 forward, E5M2 gradients) or e4m3
  /// Fused casts to switch off (nn::parse_fusions: "all" or names): a bisecting aid; every
  /// fusion gives bitwise the unfused result, so this changes speed, never the numbers.
  std::string unfuse;
  /// Attention on CUDA (ops::AttentionChoice): flash, cudnn or auto; "" leaves OCTET_ATTENTION's
  /// choice (auto by default). Both paths are deterministic; they round differently.
  std::string attention;
  std::string model;  ///< preset; default tiny on CPU, gpt2-124m on GPU
  int64_t layers = 0, dim = 0, heads = 0, ffn = 0, vocab = 0;  ///< preset overrides
  /// Mixture-of-experts overrides of the preset (ModelConfig): experts (-1: the preset's; 0:
  /// dense), topk and moe_every (0: the preset's), the experts' activation ("": the preset's),
  /// the aux-loss and z-loss weights (< 0: the preset's), the router's scoring ("": the preset's),
  /// a shared expert (false: the preset's).
  int64_t experts = -1, topk = 0, moe_every = 0;
  std::string moe_activation;
  double aux_loss_coef = -1;
  std::string router;
  double z_loss_coef = -1;
  bool shared_expert = false;
  std::string data = "builtin";
  int64_t steps = 0;
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t accum = 1;
  double lr = 0;        ///< peak learning rate; 0 = default_learning_rate(model width)
  int64_t warmup = -1;  ///< warmup steps; -1 = default_warmup(width), whatever --steps is
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  uint64_t seed = 1337;
  bool recompute = false;
  bool deterministic = false;
  std::string out = "runs/latest";
  int64_t save_every = 0;       ///< 0: only at the end
  int64_t keep = kDefaultKeep;  ///< checkpoints kept in `out`; 0: all
  std::string resume;           ///< a checkpoint file, or a run directory (its newest checkpoint)
  int64_t eval_every = 0;       ///< 0: only at the end
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
  /// ZeRO stage: 0 (every rank holds all optimizer state) or 1 (the AdamW moments sharded over
  /// the data-parallel ranks, zero.h). Bitwise the same results either way.
  int64_t zero = 0;
  /// The dtype of the gradient all-reduce across ranks: fp32, or bf16 (half the bytes, each
  /// gradient rounded to bf16; data_parallel.h says what it costs).
  std::string grad_reduce_dtype = "fp32";
  /// The gradient buckets' size in MiB of FP32 gradients (grad_buckets.h): each bucket's
  /// reduction starts as soon as the backward has finished it. 0: one reduction after the
  /// backward. The same results either way (bitwise for two ranks). The default is PyTorch DDP's
  /// bucket_cap_mb: a bucket's collective is bandwidth-bound, and the first starts early.
  double grad_bucket_mb = 25;
  /// Testing aid: faults to inject on purpose (fault_injection.h), e.g. "nan-grad@5". "": none.
  std::string inject;
};

/// Resolves "auto"/defaults for the machine: device, model preset, steps, batch, seq; and the
/// learning rate (by the model's width) and warmup.
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

}  // namespace octet::train
