// The training checkpoint's schema: tensors, metadata, restore and the resume checks.
#include "octet/train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <system_error>

#include "octet/core/error.h"
#include "octet/nn/fp8_state.h"
#include "octet/ops/attention.h"
#include "octet/train/metrics.h"

namespace octet::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kCheckpointPrefix = "checkpoint-";
constexpr const char* kCheckpointSuffix = ".safetensors";
// What write_file_atomically / link_atomically append to a name while writing it.
constexpr const char* kTemporaryMarker = ".tmp.";
// Digits of the step in a checkpoint's name, so that names sort as steps up to 10^6.
constexpr int kStepDigits = 6;
// Longest step in a name: 18 digits always fit in int64_t.
constexpr size_t kMaxStepDigits = 18;

bool all_digits(const std::string& text) {
  return !text.empty() &&
         std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c); });
}

/// The step of a checkpoint file name, or nothing for any other name.
std::optional<int64_t> step_of(const std::string& name) {
  const std::string prefix = kCheckpointPrefix, suffix = kCheckpointSuffix;
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) ||
      !name.ends_with(suffix))
    return std::nullopt;
  const std::string digits =
      name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > kMaxStepDigits || !all_digits(digits)) return std::nullopt;
  return std::stoll(digits);
}

/// Removes `path`, ignoring a file that is already gone (pruning must not fail a save).
void remove_quietly(const fs::path& path) {
  std::error_code ignored;
  fs::remove(path, ignored);
}

/// Removes what writes interrupted by a crash left behind in run directory `dir`: the temporary
/// files "<name>.tmp.<pid>" of other processes, for the checkpoints, their link and the metrics
/// (rewritten when a run resumes).
void remove_interrupted_saves(const fs::path& dir) {
  const std::string own = std::to_string(::getpid());
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    const size_t marker = name.rfind(kTemporaryMarker);
    if (marker == std::string::npos) continue;
    const std::string pid = name.substr(marker + std::strlen(kTemporaryMarker));
    const bool octet_file = name.starts_with("checkpoint") || name.starts_with("metrics.jsonl");
    if (octet_file && all_digits(pid) && pid != own) remove_quietly(entry.path());
  }
}

json config_json(const ModelConfig& c) {
  json j{{"preset", c.preset},     {"arch", std::string(arch_name(c.arch))},
         {"layers", c.layers},     {"dim", c.dim},
         {"heads", c.heads},       {"ffn", c.ffn},
         {"vocab", c.vocab},       {"max_seq", c.max_seq},
         {"norm_eps", c.norm_eps}, {"rope_theta", c.rope_theta}};
  // Only MoE models carry the MoE fields, so a dense model's metadata is what it always was.
  if (c.experts > 0) {
    j["experts"] = c.experts;
    j["topk"] = c.topk;
    j["moe_every"] = c.moe_every;
    j["moe_activation"] = c.moe_activation;
    j["aux_loss_coef"] = c.aux_loss_coef;
    j["router"] = c.router;
    j["z_loss_coef"] = c.z_loss_coef;
    j["shared_expert"] = c.shared_expert;
  }
  return j;
}

ModelConfig config_from_json(const json& j) {
  ModelConfig c;
  c.preset = j.at("preset").get<std::string>();
  std::string arch = j.at("arch").get<std::string>();
  OCTET_CHECK(arch == "gpt2" || arch == "llama", "checkpoint config: unknown arch '", arch, "'");
  c.arch = arch == "gpt2" ? Arch::gpt2 : Arch::llama;
  c.layers = j.at("layers");
  c.dim = j.at("dim");
  c.heads = j.at("heads");
  c.ffn = j.at("ffn");
  c.vocab = j.at("vocab");
  c.max_seq = j.at("max_seq");
  c.norm_eps = j.at("norm_eps");
  c.rope_theta = j.at("rope_theta");
  if (j.contains("experts")) {
    c.experts = j.at("experts");
    c.topk = j.at("topk");
    c.moe_every = j.at("moe_every");
    c.moe_activation = j.at("moe_activation").get<std::string>();
    c.aux_loss_coef = j.at("aux_loss_coef");
    c.router = j.at("router").get<std::string>();
    c.z_loss_coef = j.at("z_loss_coef");
    c.shared_expert = j.at("shared_expert");
  }
  c.validate();
  return c;
}

/// The FP8 state tensors of one module under checkpoint names "fp8.<module>.<pass>.<field>".
std::vector<std::pair<std::string, Tensor>> fp8_state_tensors(const Fp8Module& module) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto [pass, tag] : {std::pair{nn::Pass::forward, "fwd"}, {nn::Pass::backward, "bwd"}}) {
    const ops::ScalingGroup& g = module.state->group(pass);
    std::string prefix = "fp8." + module.name + "." + tag + ".";
    out.emplace_back(prefix + "scale", g.scale);
    out.emplace_back(prefix + "scale_inv", g.scale_inv);
    out.emplace_back(prefix + "amax_history", g.amax_history);
  }
  return out;
}

}  // namespace

TrainState make_train_state(const ModelConfig& config, const Precision& precision,
                            const Device& device, uint64_t seed, bool recompute,
                            std::shared_ptr<nn::AmaxReducer> amax_reducer) {
  return make_train_state(config, precision, std::vector<Device>{device}, seed, recompute,
                          std::move(amax_reducer));
}

TrainState make_train_state(const ModelConfig& config, const Precision& precision,
                            const std::vector<Device>& stages, uint64_t seed, bool recompute,
                            std::shared_ptr<nn::AmaxReducer> amax_reducer) {
  TrainState s;
  s.model =
      std::make_unique<GPT>(config, precision, stages, seed, recompute, std::move(amax_reducer));
  s.params = s.model->parameters();
  for (const Parameter& p : s.params) {  // each parameter's moments beside it
    s.adam_m.push_back(Tensor::zeros(p.value.shape(), DType::f32, p.value.device()));
    s.adam_v.push_back(Tensor::zeros(p.value.shape(), DType::f32, p.value.device()));
  }
  return s;
}

int64_t master_bytes(const TrainState& s) {
  int64_t bytes = 0;
  for (const Parameter& p : s.params)
    if (p.value.defined()) bytes += static_cast<int64_t>(p.value.nbytes());
  return bytes;
}

std::vector<std::pair<std::string, Tensor>> checkpoint_tensors(TrainState& s) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t i = 0; i < s.params.size(); ++i) {
    OCTET_CHECK(s.params[i].value.defined() && s.adam_m[i].defined() && s.adam_v[i].defined(),
                "checkpoint_tensors: ", s.params[i].name,
                "'s master or AdamW moments are held by "
                "another rank (ZeRO-1): gather them first (ZeroOptimizer::gather)");
    tensors.emplace_back("param." + s.params[i].name, s.params[i].value);
    tensors.emplace_back("adam_m." + s.params[i].name, s.adam_m[i]);
    tensors.emplace_back("adam_v." + s.params[i].name, s.adam_v[i]);
  }
  for (const Fp8Module& m : s.model->fp8_modules())
    for (auto& t : fp8_state_tensors(m)) tensors.push_back(std::move(t));
  return tensors;
}

void restore_tensors(const SafetensorsFile& file, TrainState& s) {
  auto tensors = checkpoint_tensors(s);
  for (const auto& [name, t] : tensors) {
    OCTET_CHECK(file.contains(name), "checkpoint ", file.path(), " has no tensor '", name,
                "': it was written for another model or precision");
    OCTET_CHECK(file.shape(name) == t.shape() && file.dtype(name) == t.dtype(), "checkpoint ",
                file.path(), ": tensor '", name, "' is ", dtype_name(file.dtype(name)),
                shape_str(file.shape(name)), ", expected ", dtype_name(t.dtype()),
                shape_str(t.shape()));
  }
  for (auto& [name, t] : tensors) {
    Tensor target = t;
    target.copy_from(file.get(name));
  }
  // A checkpoint is taken after at least one step: its histories hold amaxes to scale from.
  for (const Fp8Module& m : s.model->fp8_modules())
    for (nn::Pass pass : {nn::Pass::forward, nn::Pass::backward}) m.state->set_calibrated(pass, true);
}

std::string metadata_at(const SafetensorsFile& file, const std::string& key) {
  auto it = file.metadata().find(key);
  OCTET_CHECK(it != file.metadata().end(), "checkpoint ", file.path(), " lacks metadata '", key,
              "': not an octet training checkpoint");
  return it->second;
}

uint64_t metadata_uint(const SafetensorsFile& file, const std::string& key, uint64_t max) {
  const std::string text = metadata_at(file, key);
  uint64_t value = 0;
  bool valid = !text.empty() && text.size() <= std::numeric_limits<uint64_t>::digits10 + 1;
  for (const char c : text) {
    valid = valid && c >= '0' && c <= '9' && !__builtin_mul_overflow(value, 10, &value) &&
            !__builtin_add_overflow(value, static_cast<uint64_t>(c - '0'), &value);
  }
  OCTET_CHECK(valid && value <= max, "checkpoint ", file.path(), ": metadata '", key,
              "' expected an integer in [0, ", max, "], got '", text, "'");
  return value;
}

void check_config_matches_tensors(const SafetensorsFile& file, const ModelConfig& config) {
  int64_t held = 0;
  for (const std::string& name : file.names()) {
    if (!name.starts_with("param.")) continue;
    int64_t elements = 1;
    for (int64_t extent : file.shape(name)) elements *= extent;  // bounded by the file's size
    held += elements;
  }
  OCTET_CHECK(held == config.parameter_count(), "checkpoint ", file.path(),
              ": its config metadata describes ", config.describe(), ", but its param.* tensors ",
              "hold ", held, " parameters; the metadata does not match the tensors");
}

ModelConfig checkpoint_config(const SafetensorsFile& file) {
  try {
    return config_from_json(json::parse(metadata_at(file, "config")));
  } catch (const json::exception& e) {
    OCTET_ERROR("checkpoint ", file.path(), ": unreadable config metadata (", e.what(), ")");
  }
}

std::string rounding_context(const TrainOptions& o) {
  if (!Device::parse_list(o.device).front().is_cuda()) return "cpu";
  return std::string("cuda, attention ") + ops::attention_choice_name(ops::attention_choice());
}

std::optional<std::string> rounding_change(const SafetensorsFile& file,
                                           const std::map<std::string, std::string>& expected) {
  const auto held = file.metadata().find("rounding");
  if (held == file.metadata().end() || held->second == expected.at("rounding")) return std::nullopt;
  return "checkpoint " + file.path() + " was written on " + held->second + ", this run is on " +
         expected.at("rounding") + ": the continuation is deterministic, but not bitwise the " +
         "uninterrupted run";
}

std::map<std::string, std::string> run_metadata(const TrainOptions& o, const ModelConfig& config,
                                                const Precision& p, const TokenSource& data,
                                                int64_t step) {
  return {{"config", config_json(config).dump()},
          {"rounding", rounding_context(o)},
          {"precision", p.name()},
          {"recipe", p.kind == Precision::Kind::fp8 ? p.recipe.describe() : ""},
          {"step", std::to_string(step)},
          {"seed", std::to_string(o.seed)},
          {"data", o.data},
          {"data_position", to_string(data.position())},
          {"batch", std::to_string(o.batch)},
          {"seq", std::to_string(o.seq)},
          {"accum", std::to_string(o.accum)},
          {"lr", format_double(o.lr)},
          {"warmup", std::to_string(o.warmup)},
          {"weight_decay", format_double(o.weight_decay)},
          {"grad_clip", format_double(o.grad_clip)}};
}

/// The recipe description of `precision`'s defaults ("" for bf16 and fp32).
std::string default_recipe_description(const std::string& precision) {
  const Precision p = Precision::from_name(precision);
  return p.kind == Precision::Kind::fp8 ? p.recipe.describe() : "";
}

void check_resume_compatible(const SafetensorsFile& file,
                             const std::map<std::string, std::string>& expected) {
  // The expert count first, with the flag that fixes it: the config line below would say it too,
  // buried in two JSON objects.
  const int64_t held = checkpoint_config(file).experts;
  const int64_t here = config_from_json(json::parse(expected.at("config"))).experts;
  OCTET_CHECK(held == here, "checkpoint ", file.path(), " is ",
              held > 0 ? "an MoE model with " + std::to_string(held) + " experts"
                       : std::string("a dense model"),
              ", but this run ", here > 0 ? "has " + std::to_string(here) + " experts" : "is dense",
              "; resume with ", held > 0 ? "--experts " + std::to_string(held) : "no --experts");
  for (const char* key : {"config", "precision", "recipe", "data", "batch", "seq", "accum", "lr",
                          "warmup", "weight_decay", "grad_clip", "seed"}) {
    // Checkpoints from before the recipe's knobs were stored ran the precision's default recipe.
    const bool defaulted = std::string_view(key) == "recipe" && !file.metadata().contains(key);
    std::string have = defaulted ? default_recipe_description(metadata_at(file, "precision"))
                                 : metadata_at(file, key);
    OCTET_CHECK(have == expected.at(key), "checkpoint ", file.path(),
                " is from an incompatible run: ", key, " is ", have, " there, but ",
                expected.at(key), " here");
  }
}

// ----------------------------------------------------------------------------
// The checkpoints of a run directory

std::string checkpoint_file_name(int64_t step) {
  char digits[32];
  std::snprintf(digits, sizeof digits, "%0*lld", kStepDigits, static_cast<long long>(step));
  return kCheckpointPrefix + std::string(digits) + kCheckpointSuffix;
}

std::vector<CheckpointFile> list_checkpoints(const fs::path& dir) {
  std::vector<CheckpointFile> out;
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, error)) {
    const std::optional<int64_t> step = step_of(entry.path().filename().string());
    if (step && entry.is_regular_file(error)) out.push_back({*step, entry.path()});
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointFile& a, const CheckpointFile& b) { return a.step < b.step; });
  return out;
}

std::optional<fs::path> newest_checkpoint(const fs::path& dir) {
  const std::vector<CheckpointFile> files = list_checkpoints(dir);
  for (auto it = files.rbegin(); it != files.rend(); ++it) {
    try {
      load_safetensors(it->path.string());
      return it->path;
    } catch (const Error& e) {
      std::fprintf(stderr, "octet: warning: passing over %s: %s\n", it->path.c_str(),
                   e.message().c_str());
    }
  }
  const fs::path old_layout = dir / kNewestCheckpointLink;
  std::error_code error;
  if (files.empty() && fs::is_regular_file(fs::symlink_status(old_layout, error)))
    return old_layout;
  return std::nullopt;
}

std::string resolve_checkpoint(const std::string& path) {
  std::error_code error;
  if (!fs::is_directory(path, error)) return path;
  const std::optional<fs::path> newest = newest_checkpoint(path);
  OCTET_CHECK(newest.has_value(), "run directory '", path, "' holds no complete checkpoint (",
              kCheckpointPrefix, "<step>", kCheckpointSuffix, ")");
  return newest->string();
}

fs::path save_checkpoint(const fs::path& dir, int64_t step,
                         const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata, int64_t keep) {
  fs::create_directories(dir);
  remove_interrupted_saves(dir);  // before writing: a full disk may need their space
  const fs::path path = dir / checkpoint_file_name(step);
  try {
    save_safetensors(path.string(), tensors, metadata);
  } catch (const Error& e) {
    const std::optional<fs::path> newest = newest_checkpoint(dir);
    OCTET_ERROR("checkpoint of step ", step, " not saved: ", e.message(), "; ",
                newest ? "the newest complete checkpoint is " + newest->string() +
                             ": free space and continue with --resume " + dir.string()
                       : std::string("there is no earlier checkpoint in ") + dir.string());
  }
  link_atomically((dir / kNewestCheckpointLink).string(), path.filename().string());

  std::vector<CheckpointFile> files = list_checkpoints(dir);
  int64_t older = 0;
  for (const CheckpointFile& f : files) older += f.step < step;
  for (const CheckpointFile& f : files) {
    // Later steps belong to a run this one replaces; beyond `keep`, the oldest go.
    const bool superseded = f.step > step;
    const bool beyond_keep = keep > 0 && f.step < step && older-- >= keep;
    if (superseded || beyond_keep) remove_quietly(f.path);
  }
  return path;
}

int64_t resume_from(const SafetensorsFile& file, const std::map<std::string, std::string>& expected,
                    TrainState& s, TokenSource& data) {
  check_resume_compatible(file, expected);
  const auto step = static_cast<int64_t>(metadata_uint(file, "step"));
  const DataPosition position = parse_data_position(metadata_at(file, "data_position"));
  restore_tensors(file, s);
  s.step = step;
  data.set_position(position);
  return step;
}

}  // namespace octet::train
