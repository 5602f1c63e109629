// Data parallelism for `octet train`: N processes (ranks) each train a replica of the model on
// their share of every step's microbatches, and reduce gradients, the loss, the FP8 amaxes and
// the step's skip decision so that every replica takes the same step.
//
// Semantics. --accum is the number of microbatches per optimizer step over the whole world, so
// the same command trains the same model at any world size (up to float summation order): rank r
// of N computes microbatches [r*A, (r+1)*A) of each step, A = accum / N. Every rank reads the
// whole step's batches from the same stream (same data, same seed) and keeps its own, so the data
// position, and with it a checkpoint, is the same on every rank and for every world size.
// Each microbatch's gradient is scaled by 1/accum before the reduction (as one process scales
// it), so the rank-0-ordered FP32 sum of the ranks' gradients is the mean over the global batch.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "octet/core/tensor.h"
#include "octet/dist/communicator.h"
#include "octet/train/grad_buckets.h"
#include "octet/train/step_checks.h"
#include "octet/train/trainer.h"

namespace octet::train {

class DataParallel {
 public:
  /// A world of one (no reductions) when `comm` is null or of size 1.
  explicit DataParallel(std::shared_ptr<dist::Communicator> comm = nullptr);

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// More than one rank: the reductions run.
  bool active() const { return size_ > 1; }
  /// Rank 0: the one that prints, writes metrics, plots and checkpoints.
  bool is_root() const { return rank_ == 0; }
  /// The communicator, e.g. "mpi, 2 ranks".
  std::string describe() const { return comm_ ? comm_->describe() : "single process"; }
  /// Returns when every rank has called it.
  void barrier() const {
    if (active()) comm_->barrier();
  }

  /// Checks, on every rank together, that the options are the same on every rank (a hash of all
  /// of them, broadcast from rank 0) and that the world size divides --accum, and that the run
  /// uses nothing DP does not support yet. Throws dist::CollectiveError on every rank otherwise.
  void check_run(const TrainOptions& options) const;

  /// Whether microbatch `micro` (0 .. accum - 1) of a step is this rank's.
  bool owns(int64_t micro, int64_t accum) const {
    const int64_t per_rank = accum / size_;
    return micro / per_rank == rank_;
  }

  /// The dtype of the gradient reduction: "fp32" (the default) or "bf16" (--grad-reduce-dtype).
  /// bf16 sends half the bytes; each gradient is rounded to bf16 (a relative error of up to
  /// 2^-8) and each partial sum too, so a summed element is off by up to
  /// (2N - 1) * 2^-8 * (sum of |terms|) for N ranks (tests/dist/communicator_test.cc): noise of
  /// the size of bf16 compute, which AdamW's normalized update mostly absorbs.
  void set_grad_reduce_dtype(const std::string& name);

  /// The communicator (a SingleProcess for a world of one).
  const std::shared_ptr<dist::Communicator>& communicator() const { return comm_; }

  /// Whether microbatch `micro` is this rank's last of the step (its backward completes the
  /// gradients).
  bool last_owned(int64_t micro, int64_t accum) const {
    return micro == (rank_ + 1) * (accum / size_) - 1;
  }

  /// The hook that starts the gradient buckets' sums during the step's last backward
  /// (grad_buckets.h) for `params` (parameters() order) in buckets of `bucket_mb` MiB
  /// (--grad-bucket-mb), made on the first call (after set_grad_reduce_dtype). Null for a world
  /// of one or for bucket_mb 0 (reduce_gradients then reduces everything in one collective).
  GradientReadyHook* gradient_hook(std::span<const Parameter> params, double bucket_mb);
  /// The number of gradient buckets (1 without gradient_hook's).
  size_t bucket_count() const;

  /// Sums the gradients (FP32 tensors, in the given order: parameters()' order) and `loss` (this
  /// rank's sum of its microbatches' losses) over the ranks, in the grad-reduce dtype; every rank
  /// ends with the same gradients. With gradient_hook's buckets, `grads` must be its `params`'
  /// gradients: the buckets not started yet start, and every bucket is waited for. Returns the
  /// sum of the losses over every rank.
  double reduce_gradients(std::span<const Tensor> grads, double loss);

  /// Makes every rank take the same decision on a step: the verdict with the highest
  /// SkipReason over the ranks (none only when no rank would skip).
  void agree(StepVerdict& verdict);

  /// The model registry's amax reducer (null for a world of one).
  std::shared_ptr<nn::AmaxReducer> amax_reducer() const;

 private:
  std::shared_ptr<dist::Communicator> comm_;
  int rank_ = 0, size_ = 1;
  Tensor loss_, skip_;  ///< f32[1] host buffers of the step's reductions
  /// The sum of `loss` over the ranks (f32).
  double sum_loss(double loss);

  DType grad_reduce_dtype_ = DType::f32;
  Tensor bf16_flat_;  ///< the bf16 gradients of one reduction, on the gradients' device
  std::unique_ptr<GradBucketReducer> buckets_;  ///< gradient_hook's, once made
};

/// A hash of every field of `options` (FNV-1a over their text), equal on every rank that was
/// given the same options.
uint64_t options_fingerprint(const TrainOptions& options);

}  // namespace octet::train
