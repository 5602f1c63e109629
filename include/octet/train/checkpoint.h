// The training checkpoint: which tensors a run saves (weights, AdamW moments, FP8 state), the
// run metadata beside them, restoring them and the checks that a resumed run is the same run.
// The file format itself (safetensors, atomic writes) is octet/train/safetensors.h.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "octet/ops/optimizer.h"
#include "octet/train/config.h"
#include "octet/train/data.h"
#include "octet/train/model.h"
#include "octet/train/safetensors.h"
#include "octet/train/trainer.h"

namespace octet::train {

/// Model, optimizer moments and where training stands: what a checkpoint holds.
struct TrainState {
  std::unique_ptr<GPT> model;
  std::vector<Parameter> params;
  std::vector<Tensor> adam_m, adam_v;
  int64_t step = 0;
  /// params and moments as the multi-tensor AdamW step takes them; built by the first step (not
  /// checkpointed: restoring copies into the same tensors, so the table stays valid).
  std::vector<ops::AdamWTensor> adamw;
};

/// Model and zeroed AdamW moments on `device`.
TrainState make_train_state(const ModelConfig& config, const Precision& precision,
                            const Device& device, uint64_t seed, bool recompute);

/// The tensors a checkpoint of `s` holds, under their checkpoint names ("param.<name>",
/// "adam_m.<name>", "adam_v.<name>", "fp8.<module>.<fwd|bwd>.<scale|scale_inv|amax_history>").
std::vector<std::pair<std::string, Tensor>> checkpoint_tensors(TrainState& s);

/// Copies every tensor of `s` from the checkpoint, checking shapes first so a mismatched file
/// changes nothing.
void restore_tensors(const SafetensorsFile& file, TrainState& s);

/// The metadata value `key`; throws naming the file when it is missing.
std::string metadata_at(const SafetensorsFile& file, const std::string& key);

/// The model config recorded in the checkpoint's metadata, validated.
ModelConfig checkpoint_config(const SafetensorsFile& file);

/// The metadata a checkpoint of this run at `step` records.
std::map<std::string, std::string> run_metadata(const TrainOptions& o, const ModelConfig& config,
                                                const Precision& p, const TokenSource& data,
                                                int64_t step);

/// Fields that must agree between a checkpoint and the run resuming it (or the continuation is
/// not the same training run).
void check_resume_compatible(const SafetensorsFile& file,
                             const std::map<std::string, std::string>& expected);

}  // namespace octet::train
