// The commands that use a trained model: eval, generate, inspect; and the bench printing.
#include "octet/train/commands.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "octet/core/error.h"
#include "octet/train/checkpoint.h"
#include "octet/train/trainer.h"

namespace octet::train {
namespace {

// Problems scored for the builtin corpus's arithmetic accuracy.
constexpr int kArithmeticProblems = 200;

Tensor ids_tensor(const std::vector<int32_t>& ids, int64_t rows) {
  Tensor t = Tensor::empty({rows}, DType::i32);
  std::copy(ids.begin(), ids.end(), t.data<int32_t>());
  return t;
}

/// Greedy (temperature 0) or sampled continuation of `prompt` (byte-level vocabularies).
std::string generate_text(GPT& model, const std::string& prompt, int64_t max_new,
                          double temperature, std::mt19937_64* rng, bool stop_at_newline) {
  const int64_t max_seq = model.config().max_seq;
  std::vector<int32_t> tokens(prompt.begin(), prompt.end());
  for (int32_t& t : tokens) t = static_cast<uint8_t>(t);
  std::string out;
  for (int64_t n = 0; n < max_new; ++n) {
    // Keep the last max_seq tokens; pad on the right to the FP8 token multiple (causal attention
    // makes the padding invisible to the position we read).
    int64_t begin = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - max_seq);
    std::vector<int32_t> window(tokens.begin() + begin, tokens.end());
    const int64_t length = static_cast<int64_t>(window.size());
    int64_t padded =
        std::min(max_seq, (length + kTokenMultiple - 1) / kTokenMultiple * kTokenMultiple);
    padded = std::max(padded, length);
    window.resize(padded, 0);
    Tensor logits = model.logits_at(ids_tensor(window, padded), 1, padded, length - 1);
    const float* l = logits.data<float>();
    const int64_t vocab = logits.size(-1);
    int64_t next = 0;
    if (temperature <= 0) {
      for (int64_t v = 1; v < vocab; ++v)
        if (l[v] > l[next]) next = v;
    } else {
      std::vector<double> p(vocab);
      double m = *std::max_element(l, l + vocab);
      for (int64_t v = 0; v < vocab; ++v) p[v] = std::exp((l[v] - m) / temperature);
      next = std::discrete_distribution<int64_t>(p.begin(), p.end())(*rng);
    }
    if (next > 255) next = '?';  // byte-level output only
    tokens.push_back(static_cast<int32_t>(next));
    out.push_back(static_cast<char>(next));
    if (stop_at_newline && next == '\n') break;
  }
  return out;
}

}  // namespace

double validation_loss(GPT& model, TokenSource& data, int64_t batch, int64_t seq, int64_t batches) {
  const int64_t count = std::min(batches, data.val_batch_count(batch, seq));
  double total = 0;
  for (int64_t i = 0; i < count; ++i) {
    Batch b = data.val_batch(i, static_cast<int>(batch), static_cast<int>(seq));
    total += model.evaluate(b.inputs.view({-1}), b.targets.view({-1}), batch, seq);
  }
  return total / static_cast<double>(count);
}

/// The builtin corpus's measurable skill: greedy answers to held-out arithmetic prompts. Exact
/// match is the headline; the fraction of answer characters in the right place shows progress
/// long before whole answers come out right (a model that only learned the format scores ~10%).
void print_arithmetic_skill(GPT& model) {
  std::map<std::string, std::string> answers;
  for (const ArithmeticProblem& p : arithmetic_problems(kArithmeticProblems))
    answers[p.prompt] = p.answer;
  int64_t chars = 0, right = 0;
  const double exact = evaluate_arithmetic(
      [&](const std::string& prompt, int max_new) {
        std::string got = generate_text(model, prompt, max_new, 0.0, nullptr, true);
        const std::string& answer = answers.at(prompt);
        for (size_t i = 0; i < answer.size(); ++i, ++chars)
          right += i < got.size() && got[i] == answer[i];
        return got;
      },
      kArithmeticProblems);
  std::printf(
      "builtin arithmetic (%d held-out problems): exact match %.1f%%, answer characters "
      "right %.1f%%\n",
      kArithmeticProblems, 100.0 * exact,
      100.0 * static_cast<double>(right) / static_cast<double>(std::max<int64_t>(chars, 1)));
}

/// The op profiler's totals over `steps` steps of `step_ms` median wall time each, as a table:
/// device time per step, its share of the step, and the host time of the same calls (an op whose
/// host time nears its device time kept the GPU waiting for the host).
void print_profile(const std::vector<profiler::OpTime>& ops, int64_t steps, double step_ms) {
  const auto per_step = [&](double total) { return total / static_cast<double>(steps); };
  double total = 0, host_total = 0;
  std::fprintf(stderr, "%-48s %9s %10s %7s %13s\n", "op", "calls/step", "ms/step", "% step",
               "host ms/step");
  for (const auto& t : ops) {
    total += t.ms;
    host_total += t.host_ms;
    std::fprintf(stderr, "%-48s %9.1f %10.3f %6.1f%% %13.3f\n", t.op.c_str(),
                 static_cast<double>(t.calls) / static_cast<double>(steps), per_step(t.ms),
                 100.0 * per_step(t.ms) / step_ms, per_step(t.host_ms));
  }
  std::fprintf(stderr, "%-48s %9s %10.3f %6.1f%% %13.3f\n", "all ops", "", per_step(total),
               100.0 * per_step(total) / step_ms, per_step(host_total));
  std::fprintf(stderr, "%-48s %9s %10.3f %6.1f%%\n", "step (median wall time)", "", step_ms, 100.0);
}

void print_train_bench(const TrainBenchResult& r) {
  const MemoryByKind& m = r.memory;
  std::printf(
      "{\"bench\":\"train\",\"model\":\"%s\",\"precision\":\"%s\",\"device\":\"%s\","
      "\"batch\":%lld,\"seq\":%lld,\"accum\":%lld,\"recompute\":%s,\"steps\":%lld,"
      "\"tokens_per_s\":%.9g,\"peak_gib\":%.4f,\"params\":%lld,\"last_loss\":%.6g,"
      "\"peak_by_kind_gib\":{\"weights\":%.4f,\"gradients\":%.4f,\"optimizer\":%.4f,"
      "\"weight_casts\":%.4f,\"workspace\":%.4f,\"activations\":%.4f},\"timed_gemm_plans\":%lld,"
      "\"timed_gemm_plan_ms\":%.3f,\"allocations_per_step\":%.1f,\"unfused\":\"%s\","
      "\"attention\":\"%s\",\"world_size\":%d,\"zero\":%lld,"
      "\"masters_and_moments_max_gib\":%.4f}\n",
      r.model.c_str(), r.precision.c_str(), r.device.c_str(), (long long)r.batch, (long long)r.seq,
      (long long)r.accum, r.recompute ? "true" : "false", (long long)r.steps, r.tokens_per_s,
      r.peak_gib, (long long)r.params, r.last_loss, m.weights, m.gradients, m.optimizer,
      m.weight_casts, m.workspace,
      r.peak_gib - m.weights - m.gradients - m.optimizer - m.weight_casts - m.workspace,
      (long long)r.timed_gemm_plans, r.timed_gemm_plan_ms, r.allocations_per_step,
      r.unfused.c_str(), r.attention.c_str(), r.world_size, (long long)r.zero,
      r.masters_and_moments_max_gib);
}

namespace {
/// A model restored from a checkpoint for eval/generate.
struct LoadedModel {
  SafetensorsFile file;
  ModelConfig config;
  Precision precision;
  std::unique_ptr<GPT> model;
};

/// `path`: a checkpoint file or a run directory (its newest checkpoint).
LoadedModel load_model(const std::string& path, const std::string& device_name) {
  LoadedModel m;
  m.file = load_safetensors(resolve_checkpoint(path));
  const SafetensorsFile& file = m.file;
  m.config = checkpoint_config(file);
  check_config_matches_tensors(file, m.config);  // before allocating the model it describes
  m.precision = Precision::from_name(metadata_at(file, "precision"));
  std::string dev =
      device_name == "auto" ? (cuda_device_count() > 0 ? "cuda" : "cpu") : device_name;
  const Device device = Device::parse(dev);
  check_device_available(device);
  TrainState s = make_train_state(m.config, m.precision, device, 0, false);
  restore_tensors(file, s);
  s.model->on_weights_updated();
  m.model = std::move(s.model);
  return m;
}
}  // namespace

void run_eval(const std::string& checkpoint, const std::string& device, int64_t batches) {
  OCTET_CHECK(batches > 0, "batches must be positive, got ", batches);
  LoadedModel m = load_model(checkpoint, device);
  const std::string spec = metadata_at(m.file, "data");
  auto data =
      make_token_source(spec, metadata_uint(m.file, "seed", std::numeric_limits<uint64_t>::max()));
  const auto batch = static_cast<int64_t>(metadata_uint(m.file, "batch"));
  const auto seq = static_cast<int64_t>(metadata_uint(m.file, "seq"));
  // The token sources count tokens in int.
  constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();
  OCTET_CHECK(seq >= 1 && seq <= m.config.max_seq && batch >= 1 && batch <= kMaxTokens / seq,
              "checkpoint ", m.file.path(), ": expected 1 <= seq <= max_seq (", m.config.max_seq,
              ") and 1 <= batch x seq <= ", kMaxTokens, " in its metadata, got batch ", batch,
              ", seq ", seq);
  const int64_t count = std::min(batches, data->val_batch_count(batch, seq));
  OCTET_CHECK(count > 0, "the validation split of ", spec, " holds no batch of ", batch, " x ", seq,
              " tokens");
  std::printf("%s, step %s, %s precision\n", m.config.describe().c_str(),
              metadata_at(m.file, "step").c_str(), m.precision.name().c_str());
  std::printf("val loss: %.4f over %lld batch(es) of %s\n",
              validation_loss(*m.model, *data, batch, seq, batches), (long long)count,
              spec.c_str());
  if (spec == "builtin") print_arithmetic_skill(*m.model);
}

void run_generate(const std::string& checkpoint, const std::string& device,
                  const std::string& prompt, int64_t tokens, double temperature, uint64_t seed) {
  OCTET_CHECK(tokens > 0, "tokens must be positive, got ", tokens);
  LoadedModel m = load_model(checkpoint, device);
  OCTET_CHECK(!prompt.empty(), "the prompt must not be empty");
  std::mt19937_64 rng(seed);
  std::string text = generate_text(*m.model, prompt, tokens, temperature, &rng, false);
  std::printf("%s%s\n", prompt.c_str(), text.c_str());
}

namespace {
namespace fs = std::filesystem;
using nlohmann::json;

/// The last FP8 statistics that the run's metrics.jsonl holds (`--fp8-stats-every`), one line per
/// layer and cast: what each cast did to its tensor. Prints nothing without them.
void print_last_fp8_statistics(const fs::path& metrics) {
  std::ifstream in(metrics);
  json last;
  int64_t step = 0;
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("fp8") && j.contains("step")) {
      last = j["fp8"];
      step = j["step"].get<int64_t>();
    }
  }
  if (!last.is_object() || last.empty()) return;
  std::printf("\nFP8 statistics at step %lld (%s):\n", static_cast<long long>(step),
              metrics.string().c_str());
  std::printf("%-28s %-12s %12s %12s %11s %11s\n", "FP8 module", "cast", "amax", "scale",
              "saturated", "underflow");
  for (const auto& [module, roles] : last.items()) {
    for (const char* role : {"input", "weight", "grad_output"}) {
      if (!roles.contains(role)) continue;
      const json& c = roles[role];
      std::printf("%-28s %-12s %12.5g %12.5g %10.4f%% %10.4f%%\n", module.c_str(), role,
                  c.value("amax", 0.0), c.value("scale", 0.0), 100 * c.value("saturated", 0.0),
                  100 * c.value("underflow", 0.0));
    }
  }
}

}  // namespace

void run_inspect(const std::string& path) {
  const std::string checkpoint = resolve_checkpoint(path);
  SafetensorsFile file = load_safetensors(checkpoint);
  const ModelConfig config = checkpoint_config(file);
  std::printf("checkpoint: %s\n", checkpoint.c_str());
  std::printf("model:      %s\n", config.describe().c_str());
  for (const char* key : {"precision", "recipe", "step", "data", "batch", "seq", "accum", "lr",
                          "seed"}) {
    if (!file.metadata().contains(key)) continue;  // "recipe": older checkpoints ran defaults
    std::printf("%-11s %s\n", (std::string(key) + ":").c_str(), metadata_at(file, key).c_str());
  }
  std::printf("tensors:    %zu\n\n", file.names().size());
  bool any = false;
  std::printf("%-28s %12s %12s %12s %12s %12s %12s\n", "FP8 module", "in.scale", "in.amax",
              "w.scale", "w.amax", "grad.scale", "grad.amax");
  for (const std::string& name : file.names()) {
    const std::string suffix = ".fwd.scale";
    if (name.rfind("fp8.", 0) != 0 || name.size() < suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    any = true;
    const std::string module = name.substr(4, name.size() - 4 - suffix.size());
    const std::string prefix = "fp8." + module;
    std::vector<float> fwd_scale = host_values_f32(file.get(prefix + ".fwd.scale"));
    std::vector<float> bwd_scale = host_values_f32(file.get(prefix + ".bwd.scale"));
    // The newest finalized amaxes sit in history row 1 (row 0 collects the next pass).
    Tensor fwd_hist = file.get(prefix + ".fwd.amax_history");
    Tensor bwd_hist = file.get(prefix + ".bwd.amax_history");
    auto newest = [](const Tensor& h, int col) {
      std::vector<float> v = host_values_f32(h);
      const int64_t cols = h.size(-1);
      return h.size(0) > 1 ? v[cols + col] : v[col];
    };
    std::printf("%-28s %12.5g %12.5g %12.5g %12.5g %12.5g %12.5g\n", module.c_str(), fwd_scale[0],
                newest(fwd_hist, 0), fwd_scale[1], newest(fwd_hist, 1), bwd_scale[0],
                newest(bwd_hist, 0));
  }
  if (!any)
    std::printf("(no FP8 state: a %s checkpoint)\n", metadata_at(file, "precision").c_str());
  print_last_fp8_statistics(fs::path(checkpoint).parent_path() / "metrics.jsonl");
}

}  // namespace octet::train
