// The training loop, its checkpoints, and the eval / generate / inspect commands.
#include "octet/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "octet/core/allocator.h"
#include "octet/core/determinism.h"
#include "octet/core/error.h"
#include "octet/core/profiler.h"
#include "octet/nn/fp8_state.h"
#include "octet/ops/optimizer.h"
#include "octet/train/data.h"
#include "octet/train/metrics.h"
#include "octet/train/model.h"
#include "octet/train/safetensors.h"
#include "octet/train/step_checks.h"

namespace octet::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Defaults per device. The CPU default is sized to finish in under 3 minutes on 2 cores.
constexpr int64_t kCpuSteps = 300, kCpuBatch = 16, kCpuSeq = 64;
constexpr double kCpuLr = 2e-3;
constexpr int64_t kGpuSteps = 500, kGpuBatch = 16, kGpuSeq = 512;
constexpr double kGpuLr = 6e-4;
constexpr int64_t kDefaultWarmup = 20;
// AdamW moments as in GPT-2/3 training.
constexpr float kBeta1 = 0.9f, kBeta2 = 0.95f, kAdamEps = 1e-8f;
// Problems scored for the builtin corpus's arithmetic accuracy.
constexpr int kArithmeticProblems = 200;
// FP8 GEMM dimensions (tokens too) must be multiples of this (the cuBLASLt rule).
constexpr int64_t kTokenMultiple = 16;

const char* const kCheckpointFile = "checkpoint.safetensors";

// Learning rate at 1-based `step`: linear warmup, then inverse-square-root decay. The schedule
// has no horizon, so it does not depend on --steps: a run resumed with more steps continues
// exactly as an uninterrupted one.
double learning_rate(double peak, int64_t warmup, int64_t step) {
  if (warmup > 0 && step <= warmup) return peak * static_cast<double>(step) / warmup;
  return peak * std::sqrt(static_cast<double>(std::max<int64_t>(warmup, 1)) / step);
}

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

/// Copies every tensor of `s` from the checkpoint, checking shapes first so a mismatched file
/// changes nothing.
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

json fp8_statistics(GPT& model) {
  json stats = json::object();
  for (const Fp8InputStats& s : model.fp8_input_stats()) {
    stats[s.name] = json{{"input_amax", s.amax},
                         {"input_scale", s.scale},
                         {"saturated", s.saturated_fraction},
                         {"underflow", s.underflow_fraction}};
  }
  for (const Fp8Module& m : model.fp8_modules()) {
    const float weight_amax = item_f32(m.state->last_amax(fp8::TensorRole::weight));
    const float grad_amax = item_f32(m.state->last_amax(fp8::TensorRole::grad_output));
    stats[m.name]["weight_amax"] = weight_amax;
    stats[m.name]["grad_output_amax"] = grad_amax;
  }
  return stats;
}

void check_run_shape(const TrainOptions& o, const ModelConfig& config, const Precision& p) {
  OCTET_CHECK(o.steps > 0 && o.batch > 0 && o.seq > 0 && o.accum > 0,
              "steps, batch, seq and accum must be positive, got steps ", o.steps, ", batch ",
              o.batch, ", seq ", o.seq, ", accum ", o.accum);
  OCTET_CHECK(o.seq <= config.max_seq, "seq (", o.seq, ") is larger than the position table of ",
              config.preset, " (max_seq ", config.max_seq, ")");
  OCTET_CHECK(o.lr > 0 && std::isfinite(o.lr), "lr must be positive, got ", o.lr);
  if (p.kind == Precision::Kind::fp8)
    OCTET_CHECK((o.batch * o.seq) % kTokenMultiple == 0, "FP8 GEMMs need batch*seq to be a ",
                "multiple of ", kTokenMultiple, ", got ", o.batch, "*", o.seq, " = ",
                o.batch * o.seq);
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

/// Fields that must agree between a checkpoint and the run resuming it (or the continuation is
/// not the same training run).
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

std::string human_count(double n) {
  char buf[32];
  if (n >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1e6)
    std::snprintf(buf, sizeof buf, "%.1fM", n / 1e6);
  else
    std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

struct StepResult {
  double loss = 0, lr = 0;
  StepVerdict verdict;  ///< the grad norm, whether the step was skipped, the guard's flags
};

/// One optimizer step: `accum` microbatches, the checks, AdamW with clipping. A step that fails
/// the checks (a non-finite loss, gradient norm or amax; the guard, when it skips) is skipped:
/// AdamW does not run, so weights and moments stay as they were, and the FP8 state goes back to
/// its snapshot from before the step.
StepResult train_step(TrainState& s, TokenSource& data, const TrainOptions& o, StepChecks& checks) {
  const int64_t step = s.step + 1;
  StepResult r;
  checks.begin_step(step);
  // The Linear weight gradients are overwritten by the first microbatch's wgrad GEMMs instead of
  // zeroed first (a 5.9 GB pass at GPT-2 1.5B); settle_grads() covers any that did not run.
  s.model->zero_grad(nn::ZeroGrad::on_next_write);
  for (int64_t micro = 0; micro < o.accum; ++micro) {
    Batch b = data.next_batch(static_cast<int>(o.batch), static_cast<int>(o.seq));
    checks.before_microbatch(step, micro);
    r.loss += s.model->train_microbatch(b.inputs.view({-1}), b.targets.view({-1}), o.batch, o.seq,
                                        1.0f / static_cast<float>(o.accum));
    if (checks.guarding()) s.model->settle_grads();  // the guard reads them now
    checks.after_microbatch(step, micro);
  }
  r.loss /= static_cast<double>(o.accum);
  s.model->settle_grads();
  r.lr = learning_rate(o.lr, o.warmup, step);
  r.verdict = checks.finish(step, r.loss);  // reads the grad norm: the step's one host sync
  s.step = step;
  if (r.verdict.skipped()) {
    // The next forward casts the weights again from the untouched masters with the restored
    // scales, exactly as this step's forward did.
    checks.restore_fp8();
    s.model->on_weights_updated(nn::PreparedCast::dropped);
    return r;
  }

  if (s.adamw.empty()) {
    for (size_t i = 0; i < s.params.size(); ++i) {
      const float decay = s.params[i].weight_decay ? static_cast<float>(o.weight_decay) : 0.0f;
      s.adamw.push_back({s.params[i].value, s.params[i].grad, s.adam_m[i], s.adam_v[i], decay});
    }
  }
  // The next step's FP8 weight casts and bf16 copies are written with the update
  // (AdamWTensor::cast, ::bf16_copy). The table follows parameters()' order, as next_casts().
  const std::vector<ParamCast> casts = s.model->next_casts();
  OCTET_CHECK(casts.size() == s.adamw.size(), "train_step: ", casts.size(),
              " weight-cast slots for ", s.adamw.size(), " parameters");
  for (size_t i = 0; i < s.adamw.size(); ++i) {
    s.adamw[i].cast = casts[i].cast;
    s.adamw[i].bf16_copy = casts[i].bf16_copy;
  }
  ops::AdamWArgs args;
  args.lr = static_cast<float>(r.lr);
  args.beta1 = kBeta1;
  args.beta2 = kBeta2;
  args.eps = kAdamEps;
  args.step = step;
  args.max_grad_norm = static_cast<float>(o.grad_clip);
  ops::adamw_step(s.adamw.data(), static_cast<int>(s.adamw.size()), checks.norm_sq(), args);
  s.model->on_weights_updated(nn::PreparedCast::written);
  return r;
}

/// Model and zeroed AdamW moments on `device`.
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

}  // namespace

TrainOptions resolve_defaults(TrainOptions o) {
  const bool gpu_visible = cuda_device_count() > 0;
  if (o.device == "auto") o.device = gpu_visible ? "cuda" : "cpu";
  const bool on_gpu = Device::parse(o.device).is_cuda();
  if (o.model.empty()) o.model = on_gpu ? "gpt2-124m" : "tiny";
  if (o.steps == 0) o.steps = on_gpu ? kGpuSteps : kCpuSteps;
  if (o.batch == 0) o.batch = on_gpu ? kGpuBatch : kCpuBatch;
  if (o.seq == 0) o.seq = on_gpu ? kGpuSeq : kCpuSeq;
  if (o.lr == 0) o.lr = on_gpu ? kGpuLr : kCpuLr;
  if (o.warmup < 0) o.warmup = std::min<int64_t>(kDefaultWarmup, o.steps);
  return o;
}

ModelConfig resolve_model_config(const TrainOptions& o, int data_vocab) {
  ModelConfig c = model_preset(o.model);
  if (o.layers) c.layers = o.layers;
  if (o.dim) c.dim = o.dim;
  if (o.heads) c.heads = o.heads;
  if (o.ffn) c.ffn = o.ffn;
  if (o.vocab) {
    c.vocab = o.vocab;
  } else if (data_vocab < c.vocab) {
    // A byte-level corpus needs no 50k-row embedding: use the data's vocabulary (rounded up to
    // the GEMM multiple) unless --vocab says otherwise.
    c.vocab = (data_vocab + kTokenMultiple - 1) / kTokenMultiple * kTokenMultiple;
  }
  if (o.seq > c.max_seq && c.arch == Arch::llama) c.max_seq = o.seq;
  c.validate();
  OCTET_CHECK(c.vocab >= data_vocab, "vocab (", c.vocab, ") is smaller than the data's (",
              data_vocab, ")");
  return c;
}

namespace {
/// What every training command resolves before building a model: defaults, determinism, the
/// device, the precision, the data and the checked model config.
struct RunSetup {
  TrainOptions options;
  Device device;
  Precision precision;
  std::unique_ptr<TokenSource> data;
  ModelConfig config;
};

RunSetup prepare_run(const TrainOptions& requested) {
  RunSetup run;
  run.options = resolve_defaults(requested);
  const TrainOptions& o = run.options;
  if (o.deterministic) set_deterministic(true);
  run.device = Device::parse(o.device);
  check_device_available(run.device);
  run.precision = Precision::from_name(o.precision);
  run.data = make_token_source(o.data, o.seed);
  run.config = resolve_model_config(o, run.data->vocab_size());
  check_run_shape(o, run.config, run.precision);
  return run;
}
/// Runs `body`, turning a failed GPU allocation into advice for this run's options.
template <typename Body>
void with_memory_advice(const TrainOptions& o, Body&& body) {
  try {
    body();
  } catch (const OutOfMemoryError& e) {
    OCTET_ERROR(e.message(),
                ". The model, its optimizer state and the activations of one "
                "microbatch must fit: try a smaller --batch (now ",
                o.batch, "; raise --accum to keep the tokens per step)",
                o.recompute ? "" : " or --recompute (keeps only each block's input for backward)");
  }
}

void train(const TrainOptions& options) {
  RunSetup run = prepare_run(options);
  auto& [o, device, precision, data, config] = run;

  TrainState s = make_train_state(config, precision, device, o.seed, o.recompute);

  fs::create_directories(o.out);
  const std::string checkpoint_path = (fs::path(o.out) / kCheckpointFile).string();
  std::optional<int64_t> resume_step;
  if (!o.resume.empty()) {
    SafetensorsFile file = load_safetensors(o.resume);
    check_resume_compatible(file, run_metadata(o, config, precision, *data, 0));
    restore_tensors(file, s);
    s.step = std::stoll(metadata_at(file, "step"));
    data->set_position(parse_data_position(metadata_at(file, "data_position")));
    resume_step = s.step;
    OCTET_CHECK(s.step < o.steps, "checkpoint ", o.resume, " is at step ", s.step,
                ", nothing to do for --steps ", o.steps);
  }

  std::printf("octet train: %s on %s, %s precision, data %s\n", config.describe().c_str(),
              device.str().c_str(), precision.name().c_str(), data->describe().c_str());
  std::printf("  %lld steps x %lld microbatch(es) x %lld x %lld tokens, lr %g, out %s%s\n",
              (long long)o.steps, (long long)o.accum, (long long)o.batch, (long long)o.seq, o.lr,
              o.out.c_str(),
              resume_step ? (", resumed at step " + std::to_string(*resume_step)).c_str() : "");
  std::fflush(stdout);

  MetricsWriter metrics((fs::path(o.out) / "metrics.jsonl").string(), resume_step);
  ProgressDisplay progress(o.steps, o.log_every);
  StepChecks checks(*s.model, s.params, o);
  const double tokens_per_step = static_cast<double>(o.batch * o.seq * o.accum);
  double first_loss = NAN, last_loss = NAN;
  // A resumed run goes on counting the skips its metrics hold.
  SkipLog skips(o.max_skips, count_true(metrics.path(), "skipped"));
  std::optional<int64_t> saved_step;

  auto save = [&] {
    save_safetensors(checkpoint_path, checkpoint_tensors(s),
                     run_metadata(o, config, precision, *data, s.step));
    saved_step = s.step;
  };
  auto intact_checkpoint = [&]() -> std::string {
    if (saved_step)
      return "the checkpoint " + checkpoint_path + " (step " + std::to_string(*saved_step) +
             ") is intact";
    if (resume_step)
      return "the checkpoint resumed from, " + o.resume + " (step " + std::to_string(*resume_step) +
             "), is intact";
    return "no checkpoint was written yet";
  };

  while (s.step < o.steps) {
    const int64_t step = s.step + 1;
    const auto start = std::chrono::steady_clock::now();
    const bool stats = precision.kind == Precision::Kind::fp8 && o.fp8_stats_every > 0 &&
                       step % o.fp8_stats_every == 0;
    s.model->set_collect_fp8_stats(stats);
    const StepResult r = train_step(s, *data, o, checks);
    const double loss = r.loss, grad_norm = r.verdict.grad_norm, lr = r.lr;
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    MetricFields fields{{"loss", loss},
                        {"grad_norm", grad_norm},
                        {"lr", lr},
                        {"tokens_per_s", tokens_per_step / seconds}};
    skips.record(step, r.verdict, loss, fields);  // also prints a line per skip and flag
    if (stats) fields.emplace_back("fp8", fp8_statistics(*s.model));
    if (o.eval_every > 0 && step % o.eval_every == 0 && step != o.steps)
      fields.emplace_back("val_loss",
                          validation_loss(*s.model, *data, o.batch, o.seq, o.eval_batches));
    metrics.write(step, fields);
    progress.update(step, loss, tokens_per_step / seconds);
    if (std::isnan(first_loss)) first_loss = loss;
    if (!r.verdict.skipped()) last_loss = loss;
    if (skips.exhausted()) OCTET_ERROR(skips.stop_message(step, intact_checkpoint()));
    // No checkpoint on a skipped step: the file on disk stays that of the last applied one.
    if (o.save_every > 0 && step % o.save_every == 0 && !r.verdict.skipped()) save();
  }
  progress.finish();
  save();

  const double val = validation_loss(*s.model, *data, o.batch, o.seq, o.eval_batches);
  metrics.write(s.step, {{"val_loss", val}});
  std::printf("done: step %lld, train loss %.4f (first logged %.4f), val loss %.4f\n",
              (long long)s.step, last_loss, first_loss, val);
  if (o.data == "builtin" && config.vocab >= kByteVocab) {
    print_arithmetic_skill(*s.model);
  }
  if (skips.total() > 0)
    std::printf("skipped steps: %lld (\"skipped\" in metrics.jsonl)\n", (long long)skips.total());
  std::printf("checkpoint: %s\n", checkpoint_path.c_str());
  const std::string png = (fs::path(o.out) / "loss.png").string();
  if (plot_loss(metrics.path(), png)) std::printf("loss plot: %s\n", png.c_str());
  std::printf("metrics: %s (%s tokens trained)\n", metrics.path().c_str(),
              human_count(tokens_per_step * static_cast<double>(o.steps)).c_str());
}

/// The op profiler's totals over `steps` steps of `step_ms` median wall time each, as a table.
void print_profile(const std::vector<profiler::OpTime>& ops, int64_t steps, double step_ms) {
  double total = 0;
  for (const auto& t : ops) total += t.ms;
  std::fprintf(stderr, "%-48s %9s %10s %7s\n", "op", "calls/step", "ms/step", "% step");
  for (const auto& t : ops) {
    const double ms = t.ms / static_cast<double>(steps);
    std::fprintf(stderr, "%-48s %9.1f %10.3f %6.1f%%\n", t.op.c_str(),
                 static_cast<double>(t.calls) / static_cast<double>(steps), ms,
                 100.0 * ms / step_ms);
  }
  const double in_ops = total / static_cast<double>(steps);
  std::fprintf(stderr, "%-48s %9s %10.3f %6.1f%%\n", "all ops", "", in_ops,
               100.0 * in_ops / step_ms);
  std::fprintf(stderr, "%-48s %9s %10.3f %6.1f%%\n", "step (median wall time)", "", step_ms, 100.0);
}

void train_benchmark(const TrainOptions& options, int64_t warmup_steps, bool profile) {
  RunSetup run = prepare_run(options);
  auto& [o, device, precision, data, config] = run;
  reset_device_peak(device);
  TrainState s = make_train_state(config, precision, device, o.seed, o.recompute);
  StepChecks checks(*s.model, s.params, o);
  const double tokens_per_step = static_cast<double>(o.batch * o.seq * o.accum);
  std::vector<double> rates;
  double loss = 0;
  for (int64_t i = 0; i < warmup_steps + o.steps; ++i) {
    if (profile && i == warmup_steps) profiler::set_enabled(true);
    const auto start = std::chrono::steady_clock::now();
    // Syncs at the grad-norm read; the AdamW it then launches is waited for by the next step.
    loss = train_step(s, *data, o, checks).loss;
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i >= warmup_steps) rates.push_back(tokens_per_step / seconds);
  }
  std::sort(rates.begin(), rates.end());
  const double median = rates[rates.size() / 2];
  if (profile) {
    profiler::set_enabled(false);
    print_profile(profiler::collect(), o.steps, 1000.0 * tokens_per_step / median);
  }
  const double peak_gib = static_cast<double>(device_peak_bytes(device)) / (1 << 30);
  std::printf(
      "{\"bench\":\"train\",\"model\":\"%s\",\"precision\":\"%s\",\"device\":\"%s\","
      "\"batch\":%lld,\"seq\":%lld,\"accum\":%lld,\"recompute\":%s,\"steps\":%lld,"
      "\"tokens_per_s\":%.9g,\"peak_gib\":%.4f,\"params\":%lld,\"last_loss\":%.6g}\n",
      config.preset.c_str(), precision.name().c_str(), device.str().c_str(), (long long)o.batch,
      (long long)o.seq, (long long)o.accum, o.recompute ? "true" : "false", (long long)o.steps,
      median, peak_gib, (long long)config.parameter_count(), loss);
}

}  // namespace

void run_train(const TrainOptions& options) {
  with_memory_advice(options, [&] { train(options); });
}

void run_train_benchmark(const TrainOptions& options, int64_t warmup_steps, bool profile) {
  with_memory_advice(options, [&] { train_benchmark(options, warmup_steps, profile); });
}

namespace {
/// A model restored from a checkpoint for eval/generate.
struct LoadedModel {
  ModelConfig config;
  Precision precision;
  std::unique_ptr<GPT> model;
  std::map<std::string, std::string> metadata;
};

LoadedModel load_model(const std::string& path, const std::string& device_name) {
  SafetensorsFile file = load_safetensors(path);
  LoadedModel m;
  m.metadata = file.metadata();
  json config;
  try {
    config = json::parse(metadata_at(file, "config"));
    m.config = config_from_json(config);
  } catch (const json::exception& e) {
    OCTET_ERROR("checkpoint ", path, ": unreadable config metadata (", e.what(), ")");
  }
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
  LoadedModel m = load_model(checkpoint, device);
  const std::string spec = m.metadata.at("data");
  auto data = make_token_source(spec, std::stoull(m.metadata.at("seed")));
  const int64_t batch = std::stoll(m.metadata.at("batch")), seq = std::stoll(m.metadata.at("seq"));
  std::printf("%s, step %s, %s precision\n", m.config.describe().c_str(),
              m.metadata.at("step").c_str(), m.precision.name().c_str());
  std::printf("val loss: %.4f over %lld batch(es) of %s\n",
              validation_loss(*m.model, *data, batch, seq, batches),
              (long long)std::min(batches, data->val_batch_count(batch, seq)), spec.c_str());
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

void run_inspect(const std::string& checkpoint) {
  SafetensorsFile file = load_safetensors(checkpoint);
  ModelConfig config;
  try {
    config = config_from_json(json::parse(metadata_at(file, "config")));
  } catch (const json::exception& e) {
    OCTET_ERROR("checkpoint ", checkpoint, ": unreadable config metadata (", e.what(), ")");
  }
  std::printf("checkpoint: %s\n", checkpoint.c_str());
  std::printf("model:      %s\n", config.describe().c_str());
  for (const char* key : {"precision", "step", "data", "batch", "seq", "accum", "lr", "seed"})
    std::printf("%-11s %s\n", (std::string(key) + ":").c_str(), metadata_at(file, key).c_str());
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
}

}  // namespace octet::train
