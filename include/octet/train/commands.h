// The commands that use a trained model or report on training: `octet eval`, `octet generate`,
// `octet inspect`, and the printing of `octet bench train`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "octet/core/profiler.h"
#include "octet/train/data.h"
#include "octet/train/model.h"

namespace octet::train {

/// `octet eval`: val loss of a checkpoint (and arithmetic accuracy for the builtin corpus).
void run_eval(const std::string& checkpoint, const std::string& device, int64_t batches);
/// `octet generate`: samples `tokens` tokens after `prompt` (byte-level vocabularies).
void run_generate(const std::string& checkpoint, const std::string& device,
                  const std::string& prompt, int64_t tokens, double temperature, uint64_t seed);
/// `octet inspect`: the config and a table of the FP8 state per layer.
void run_inspect(const std::string& checkpoint);

/// Mean val loss over the first `batches` validation batches (fewer when the split is smaller).
double validation_loss(GPT& model, TokenSource& data, int64_t batch, int64_t seq, int64_t batches);
/// The builtin corpus's measurable skill, printed: greedy answers to held-out arithmetic prompts.
void print_arithmetic_skill(GPT& model);

/// The op profiler's totals over `steps` steps of `step_ms` median wall time each, as a table on
/// stderr.
void print_profile(const std::vector<profiler::OpTime>& ops, int64_t steps, double step_ms);

/// Peak memory of a training run by kind, in GiB, each held for the whole run: weights,
/// gradients and optimizer are the bytes of those tensors (FP32 masters, their gradients, the
/// AdamW moments); weight_casts the FP8 or BF16 copies of the weights the GEMMs read
/// (GPT::weight_cast_bytes); workspace the GEMM backend's own (ops::gemm_workspace_bytes). The
/// rest of the peak, printed as "activations", is what the step holds at that moment: the
/// blocks' records for backward, the logits, and temporaries (under data parallelism also the
/// gradient reduction's buffers, and under ZeRO-1 the gathered parameters).
struct MemoryByKind {
  double weights = 0, gradients = 0, optimizer = 0, weight_casts = 0, workspace = 0;
};

/// What `octet bench train` measured, printed as its one JSON line.
struct TrainBenchResult {
  std::string model, precision, device;
  int64_t batch = 0, seq = 0, accum = 0, steps = 0, params = 0;
  bool recompute = false;
  double tokens_per_s = 0, peak_gib = 0, last_loss = 0;
  MemoryByKind memory;
  /// GEMM plans made during the timed steps (ops::gemm_plans_made): each a host-side cuBLASLt
  /// query for a shape not seen before.
  int64_t timed_gemm_plans = 0;
  double timed_gemm_plan_ms = 0;  ///< the host time those queries took, in all timed steps
  /// Memory allocations a timed step made on the run's devices (device_allocations), the mean:
  /// on a GPU each is host time that a host-bound step pays.
  double allocations_per_step = 0;
  /// The fusions that were off (nn::disabled_fusions: --unfuse and OCTET_UNFUSE), or "none".
  std::string unfused = "none";
  /// The attention choice the run had (--attention, OCTET_ATTENTION): "flash", "cudnn" or "auto".
  std::string attention = "auto";
  /// Data-parallel ranks that ran the steps (tokens_per_s counts all of theirs; the memory is
  /// rank 0's device), and the ZeRO stage (memory.optimizer: this rank's share of the moments).
  int world_size = 1;
  int64_t zero = 0;
  /// FP32 masters plus AdamW moments on the rank that holds the most (ZeRO-1 shards both; its
  /// memory target is per GPU, and the ranks' shares differ by the tensors kept whole).
  double masters_and_moments_max_gib = 0;
};
void print_train_bench(const TrainBenchResult& r);

}  // namespace octet::train
