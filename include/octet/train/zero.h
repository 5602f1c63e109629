// ZeRO-1 for `octet train --zero 1`: the AdamW moments and the FP32 master weights sharded over
// the data-parallel ranks.
//
// Each parameter tensor has one owner: whole tensors, so the owner can cast a whole weight (a
// per-tensor FP8 scale needs the whole tensor's amax). What owning costs a rank is the tensor's
// moments, and its master where only the owner keeps it (below); laid end to end in
// parameters() order, these costs are cut into equal contiguous parts (dist::shard_range), and a
// tensor belongs to the rank whose part holds the middle of its cost, so every rank's share is
// within half a tensor of equal at either end.
//
// The owner alone keeps a tensor's moments and runs AdamW on it. The gradients are all-reduced
// whole first (DataParallel::reduce_gradients), not reduce-scattered: the global gradient norm
// that clipping reads is then computed from the same full gradients in the same order as without
// ZeRO, and AdamW is elementwise, so every update is bitwise what the unsharded step computes.
//
// The masters. A Linear's weight is read only to make that layer's casts (its FP8 copies, or its
// bf16 copy), and where the precision lets the optimizer write the next step's casts with the
// update (nn::Linear::prepare_next_cast: BF16, and FP8 delayed scaling), the owner writes them and
// sends the casts (one or two bytes an element, with the weight's amax) instead of the master
// (four). From the first step in which every rank prepared a weight's casts on (a rank prepares
// only what its layer cast before: an MoE expert may have had no rows there), the other ranks
// free that master, and every rank keeps the cast through a skipped step. Optimizer and master
// memory per rank is then about 12/N bytes a parameter, plus 4 for each one that stays whole
// everywhere:
// - the tensors the forward reads in FP32 (embeddings, norm gains, biases, the router), whose
//   owner sends the updated value itself;
// - the weights of precisions whose casts depend on data the step does not have (current scaling
//   casts with the weight's own amax at the forward, block and MXFP8 scales come from the weight's
//   blocks) or which compute in FP32: every rank recasts from its whole master, as without ZeRO.
// The casts of a whole master are each rank's own, written from the value its owner sent, as
// without ZeRO each rank writes them with its update. Losses, weights, moments and FP8 states
// equal a run without ZeRO bitwise (tests/dist/zero_test.cc). The FP8 statistics of a weight are
// measured where its master is and shared.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "octet/dist/communicator.h"
#include "octet/ops/optimizer.h"
#include "octet/train/checkpoint.h"

namespace octet::train {

class ZeroOptimizer {
 public:
  /// Keeps this rank's tensors' moments in s.adam_m / s.adam_v (zeros, or a resumed checkpoint's)
  /// and releases the others. Call on every rank after restoring a checkpoint.
  ZeroOptimizer(std::shared_ptr<dist::Communicator> comm, TrainState& s, double weight_decay);

  /// AdamW on this rank's tensors (clipped by the global `norm_sq`), writing the next step's
  /// casts where the model offers them, then each update sent from its owner to every rank: the
  /// value, or the casts of a master only its owner keeps. Leaves the model on the new weights
  /// (GPT::on_weights_updated). Collective.
  void step(TrainState& s, const Tensor& norm_sq, const ops::AdamWArgs& args);

  /// Fills s.params' values and s.adam_m / s.adam_v with whole tensors gathered from their owners
  /// (collective), so checkpoint_tensors(s) is what a run without ZeRO saves; release() frees the
  /// other ranks' again.
  void gather(TrainState& s);
  void release(TrainState& s);

  /// FP8 statistics (GPT::fp8_layer_stats) with every weight's measured on the rank that keeps its
  /// master: the others' have none. Collective: every rank passes its own.
  std::vector<Fp8LayerStats> share_weight_stats(const TrainState& s,
                                                std::vector<Fp8LayerStats> stats) const;

  /// The rank that updates parameter i (s.params order).
  int owner(size_t i) const { return owners_[i]; }
  /// The bytes owning a tensor of `numel` elements costs its owner beyond what every rank holds:
  /// its moments (8 a parameter), and its master (4) when only the owner keeps it.
  static int64_t owner_cost(int64_t numel, bool master_apart);
  /// Bytes of AdamW moments this rank holds.
  int64_t moment_bytes() const;
  /// "ZeRO-1 over 2 ranks: FP32 masters 3.3 GB and AdamW moments 6.2 GB on this rank, of 6.2 and
  /// 12.5 GB whole"
  std::string describe(const TrainState& s) const;

 private:
  bool owns(size_t i) const { return owners_[i] == comm_->rank(); }
  /// A Linear weight's master, which only its owner may keep.
  bool is_weight(size_t i) const { return layers_[i].layer != nullptr && layers_[i].weight; }
  /// Per parameter: whether every rank prepared its next cast (collective; see zero.cc).
  std::vector<bool> offered_everywhere(const std::vector<ParamCast>& casts) const;

  std::shared_ptr<dist::Communicator> comm_;
  std::vector<int> owners_;          ///< per parameter
  std::vector<int64_t> numels_;      ///< per parameter: its elements
  std::vector<float> decay_;         ///< per parameter: its AdamW weight decay
  std::vector<bool> master_apart_;   ///< per parameter: only its owner keeps the master
  std::vector<ParamLayer> layers_;   ///< per parameter: GPT::param_layers()
};

}  // namespace octet::train
