// The training checkpoint's schema: tensors, metadata, restore and the resume checks.
#include "octet/train/checkpoint.h"

#include <nlohmann/json.hpp>

#include "octet/core/error.h"
#include "octet/nn/fp8_state.h"
#include "octet/train/metrics.h"

namespace octet::train {
namespace {

using nlohmann::json;

json config_json(const ModelConfig& c) {
  return json{{"preset", c.preset},     {"arch", std::string(arch_name(c.arch))},
              {"layers", c.layers},     {"dim", c.dim},
              {"heads", c.heads},       {"ffn", c.ffn},
              {"vocab", c.vocab},       {"max_seq", c.max_seq},
              {"norm_eps", c.norm_eps}, {"rope_theta", c.rope_theta}};
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
                            const Device& device, uint64_t seed, bool recompute) {
  TrainState s;
  s.model = std::make_unique<GPT>(config, precision, device, seed, recompute);
  s.params = s.model->parameters();
  for (const Parameter& p : s.params) {
    s.adam_m.push_back(Tensor::zeros(p.value.shape(), DType::f32, device));
    s.adam_v.push_back(Tensor::zeros(p.value.shape(), DType::f32, device));
  }
  return s;
}

std::vector<std::pair<std::string, Tensor>> checkpoint_tensors(TrainState& s) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t i = 0; i < s.params.size(); ++i) {
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
}

std::string metadata_at(const SafetensorsFile& file, const std::string& key) {
  auto it = file.metadata().find(key);
  OCTET_CHECK(it != file.metadata().end(), "checkpoint ", file.path(), " lacks metadata '", key,
              "': not an octet training checkpoint");
  return it->second;
}

ModelConfig checkpoint_config(const SafetensorsFile& file) {
  try {
    return config_from_json(json::parse(metadata_at(file, "config")));
  } catch (const json::exception& e) {
    OCTET_ERROR("checkpoint ", file.path(), ": unreadable config metadata (", e.what(), ")");
  }
}

std::map<std::string, std::string> run_metadata(const TrainOptions& o, const ModelConfig& config,
                                                const Precision& p, const TokenSource& data,
                                                int64_t step) {
  return {{"config", config_json(config).dump()},
          {"precision", p.name()},
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

void check_resume_compatible(const SafetensorsFile& file,
                             const std::map<std::string, std::string>& expected) {
  for (const char* key : {"config", "precision", "data", "batch", "seq", "accum", "lr", "warmup",
                          "weight_decay", "grad_clip", "seed"}) {
    std::string have = metadata_at(file, key);
    OCTET_CHECK(have == expected.at(key), "checkpoint ", file.path(),
                " is from an incompatible run: ", key, " is ", have, " there, but ",
                expected.at(key), " here");
  }
}

}  // namespace octet::train
