// The training checkpoint: which tensors a run saves (weights, AdamW moments, FP8 state), the
// run metadata beside them, restoring them and the checks that a resumed run is the same run.
// The file format itself (safetensors, atomic writes) is octet/train/safetensors.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
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

class ZeroOptimizer;

/// Model, optimizer moments and where training stands: what a checkpoint holds.
struct TrainState {
  std::unique_ptr<GPT> model;
  std::vector<Parameter> params;
  std::vector<Tensor> adam_m, adam_v;
  int64_t step = 0;
  /// params and moments as the multi-tensor AdamW step takes them; built by the first step (not
  /// checkpointed: restoring copies into the same tensors, so the table stays valid).
  std::vector<ops::AdamWTensor> adamw;
  /// ZeRO-1 (zero.h): set when the moments are sharded over the ranks; adam_m / adam_v are then
  /// undefined except while a checkpoint is gathered.
  std::shared_ptr<ZeroOptimizer> zero;
};

/// Model and zeroed AdamW moments on `device`; `amax_reducer` goes to the model's registry.
TrainState make_train_state(const ModelConfig& config, const Precision& precision,
                            const Device& device, uint64_t seed, bool recompute,
                            std::shared_ptr<nn::AmaxReducer> amax_reducer = nullptr);
/// The same for a model split over `stages` (GPT's split constructor); each parameter's moments
/// lie on its stage's device.
TrainState make_train_state(const ModelConfig& config, const Precision& precision,
                            const std::vector<Device>& stages, uint64_t seed, bool recompute,
                            std::shared_ptr<nn::AmaxReducer> amax_reducer = nullptr);

/// The tensors a checkpoint of `s` holds, under their checkpoint names ("param.<name>",
/// "adam_m.<name>", "adam_v.<name>", "fp8.<module>.<fwd|bwd>.<scale|scale_inv|amax_history>").
std::vector<std::pair<std::string, Tensor>> checkpoint_tensors(TrainState& s);

/// Bytes of FP32 parameter values `s` holds: every master, or under ZeRO-1 (zero.h) the ones this
/// rank keeps.
int64_t master_bytes(const TrainState& s);

/// Copies every tensor of `s` from the checkpoint, checking shapes first so a mismatched file
/// changes nothing.
void restore_tensors(const SafetensorsFile& file, TrainState& s);

/// The metadata value `key`; throws naming the file when it is missing.
std::string metadata_at(const SafetensorsFile& file, const std::string& key);
/// The metadata value `key` as an integer in [0, max]; throws naming the file and key otherwise.
uint64_t metadata_uint(const SafetensorsFile& file, const std::string& key,
                       uint64_t max = std::numeric_limits<int64_t>::max());

/// The model config recorded in the checkpoint's metadata, validated.
ModelConfig checkpoint_config(const SafetensorsFile& file);

/// Checks, before anything is allocated, that the model `config` describes is the one the file's
/// "param.*" tensors hold (same parameter count): a checkpoint whose metadata claims a far larger
/// model is refused instead of allocated. Throws naming the file and both sizes.
void check_config_matches_tensors(const SafetensorsFile& file, const ModelConfig& config);

/// What decides a run's roundings besides the options the resume check compares: the device kind
/// and, on CUDA, the attention choice in force ("cpu"; "cuda, attention auto"). A checkpoint
/// stores it as "rounding"; a continuation is bitwise the uninterrupted run only under the same.
std::string rounding_context(const TrainOptions& o);

/// The sentence to print when `file` was written under another rounding context than this run's
/// (`expected`: run_metadata of this run); nullopt when they agree or the file predates the key.
std::optional<std::string> rounding_change(const SafetensorsFile& file,
                                           const std::map<std::string, std::string>& expected);

/// The metadata a checkpoint of this run at `step` records (the rounding context among it).
std::map<std::string, std::string> run_metadata(const TrainOptions& o, const ModelConfig& config,
                                                const Precision& p, const TokenSource& data,
                                                int64_t step);

/// Fields that must agree between a checkpoint and the run resuming it (or the continuation is
/// not the same training run).
void check_resume_compatible(const SafetensorsFile& file,
                             const std::map<std::string, std::string>& expected);

// ----------------------------------------------------------------------------
// The checkpoints of a run directory.
//
// Each save writes "checkpoint-<step>.safetensors" (six digits at least, so names sort by step)
// atomically: the file appears under that name only once its bytes are synced, so every file
// with such a name is complete. "checkpoint.safetensors" is a symbolic link to the newest one.
// A save keeps the `keep` newest checkpoints and removes the older ones, any checkpoint of a later
// step (a run that this one replaces, e.g. after resuming from an earlier step), and the temporary
// files of writes that a crash interrupted (checkpoints, the link, metrics.jsonl).

/// The link a run directory keeps to its newest checkpoint.
inline constexpr const char* kNewestCheckpointLink = "checkpoint.safetensors";

/// "checkpoint-000123.safetensors".
std::string checkpoint_file_name(int64_t step);

struct CheckpointFile {
  int64_t step = 0;
  std::filesystem::path path;
};
/// The checkpoints of run directory `dir`, oldest first (none when `dir` does not exist).
std::vector<CheckpointFile> list_checkpoints(const std::filesystem::path& dir);

/// The newest complete checkpoint of `dir`: the highest step whose file opens and validates
/// (a newer file that does not is named in a warning on stderr and passed over). A directory of
/// an older octet, with only a regular "checkpoint.safetensors", gives that file.
std::optional<std::filesystem::path> newest_checkpoint(const std::filesystem::path& dir);

/// `path` itself when it is a file; its newest complete checkpoint when it is a directory.
/// Throws when it is neither, or a directory without a checkpoint.
std::string resolve_checkpoint(const std::string& path);

/// Writes the checkpoint of `step` into run directory `dir` (created if needed), points the link
/// at it, then prunes as described above (`keep` 0 keeps every checkpoint). Returns its path. On a
/// failed write the message names the newest complete checkpoint, which is left as it was.
std::filesystem::path save_checkpoint(const std::filesystem::path& dir, int64_t step,
                                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                                      const std::map<std::string, std::string>& metadata,
                                      int64_t keep);

/// Restores run state `s` and `data`'s position from `file` after checking that it was written by
/// this same run (`expected`: run_metadata of this run); returns the step it holds.
int64_t resume_from(const SafetensorsFile& file, const std::map<std::string, std::string>& expected,
                    TrainState& s, TokenSource& data);

}  // namespace octet::train
