// ZeRO-1 for `octet train --zero 1`: the AdamW moments sharded over the data-parallel ranks.
//
// The parameters, as one flat buffer in parameters() order, are split into equal contiguous
// shards (dist::shard_range); rank r keeps the moments of shard r only and runs AdamW on it. The
// gradients are all-reduced whole first (DataParallel::reduce_gradients), not reduce-scattered:
// the global gradient norm that clipping reads is then computed from the same full gradients in
// the same order as without ZeRO, and AdamW is elementwise, so every updated element is bitwise
// what the unsharded step computes. An all-gather then gives every rank every updated parameter,
// and the next forward recasts its FP8 and bf16 weight copies from them (a cast cannot be written
// by a step that updates part of a tensor; the recast is bitwise the cast the optimizer writes
// without ZeRO). Losses, weights and moments therefore equal a run without ZeRO bitwise
// (tests/dist/zero_test.cc); the FP8 forward amax history records each weight amax at the next
// forward instead of at the end of the step.
//
// What is sharded: the moments, 8 bytes per parameter, drop to 8/N. The FP32 parameters stay
// whole on every rank: they are the model's weights, which the forward reads (norm gains,
// embeddings, the casts' source); sharding them needs a model that keeps only its low-precision
// copies, which octet's is not.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "octet/dist/communicator.h"
#include "octet/ops/optimizer.h"
#include "octet/train/checkpoint.h"

namespace octet::train {

class ZeroOptimizer {
 public:
  /// Takes this rank's shard of s.adam_m / s.adam_v (zeros, or a resumed checkpoint's moments)
  /// and releases s's whole moment tensors. Call on every rank after restoring a checkpoint.
  ZeroOptimizer(std::shared_ptr<dist::Communicator> comm, TrainState& s, double weight_decay);

  /// AdamW on this rank's shard of the parameters (every tensor that overlaps it, clipped by the
  /// global `norm_sq`), then the all-gather of the updated parameters. Collective.
  void step(TrainState& s, const Tensor& norm_sq, const ops::AdamWArgs& args);

  /// Fills s.adam_m / s.adam_v with whole moments gathered from every rank (collective), so
  /// checkpoint_tensors(s) is what a run without ZeRO saves; release_moments() frees them again.
  void gather_moments(TrainState& s);
  void release_moments(TrainState& s);

  /// The bytes of optimizer state (the moments) this rank holds.
  int64_t moment_bytes() const;
  /// This rank's part of the flat parameter buffer.
  dist::ShardRange shard() const { return shard_; }

 private:
  std::shared_ptr<dist::Communicator> comm_;
  dist::ShardRange shard_;
  Tensor m_, v_;  ///< f32[shard size] on the parameters' device
  /// One entry per parameter that overlaps the shard: views of its part of the parameter, the
  /// gradient and the moments.
  std::vector<ops::AdamWTensor> pieces_;
};

}  // namespace octet::train
