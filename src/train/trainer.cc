// The training loop behind `octet train` and `octet bench train`.
#include "octet/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "octet/core/allocator.h"
#include "octet/core/determinism.h"
#include "octet/core/error.h"
#include "octet/core/profiler.h"
#include "octet/dist/bootstrap.h"
#include "octet/nn/fp8_state.h"
#include "octet/nn/fusion.h"
#include "octet/ops/attention.h"
#include "octet/ops/gemm.h"
#include "octet/ops/optimizer.h"
#include "octet/train/checkpoint.h"
#include "octet/train/commands.h"
#include "octet/train/data.h"
#include "octet/train/data_parallel.h"
#include "octet/train/metrics.h"
#include "octet/train/model.h"
#include "octet/train/safetensors.h"
#include "octet/train/schedule.h"
#include "octet/train/step_checks.h"
#include "octet/train/train_step.h"
#include "octet/train/zero.h"

namespace octet::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Defaults per device. The CPU default is sized to finish in under 3 minutes on 2 cores.
// (The default learning rate depends on the model, not the device: default_learning_rate.)
constexpr int64_t kCpuSteps = 300, kCpuBatch = 16, kCpuSeq = 64;
constexpr int64_t kGpuSteps = 500, kGpuBatch = 16, kGpuSeq = 512;
// AdamW moments as in GPT-2/3 training.
constexpr float kBeta1 = 0.9f, kBeta2 = 0.95f, kAdamEps = 1e-8f;

json cast_json(const nn::CastStats& c) {
  return json{{"amax", c.amax},
              {"scale", c.scale},
              {"saturated", c.saturated_fraction},
              {"underflow", c.underflow_fraction}};
}

/// Per FP8 module: what each of its casts did (input, weight, grad_output: amax, the scale used,
/// saturated and underflowed fractions).
json fp8_statistics(const std::vector<Fp8LayerStats>& layers) {
  json stats = json::object();
  for (const Fp8LayerStats& s : layers) {
    json layer{{"input", cast_json(s.input)}, {"weight", cast_json(s.weight)}};
    if (s.grad_output.measured) layer["grad_output"] = cast_json(s.grad_output);
    stats[s.name] = std::move(layer);
  }
  return stats;
}

/// Per MoE layer ("blocks.<l>.moe"): the tokens routed to each expert, their min and max, and
/// the aux and z losses, of the step's last microbatch.
json moe_statistics(const GPT& model) {
  json stats = json::object();
  for (const MoeLayerStats& s : model.moe_layer_stats()) {
    const auto [lo, hi] = std::minmax_element(s.load.tokens.begin(), s.load.tokens.end());
    stats["blocks." + std::to_string(s.layer) + ".moe"] = json{{"tokens", s.load.tokens},
                                                               {"min", *lo},
                                                               {"max", *hi},
                                                               {"aux_loss", s.load.aux_loss},
                                                               {"z_loss", s.load.z_loss}};
  }
  return stats;
}

void check_run_shape(const TrainOptions& o, const Precision& p) {
  OCTET_CHECK(o.steps > 0 && o.batch > 0 && o.seq > 0 && o.accum > 0,
              "steps, batch, seq and accum must be positive, got steps ", o.steps, ", batch ",
              o.batch, ", seq ", o.seq, ", accum ", o.accum);
  constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();  // token ids are int32
  OCTET_CHECK(o.batch <= kMaxTokens / o.seq, "batch*seq must be at most ", kMaxTokens,
              " tokens a microbatch (token ids are int32), got ", o.batch, "*", o.seq);
  OCTET_CHECK(o.lr > 0 && std::isfinite(o.lr), "lr must be positive, got ", o.lr);
  OCTET_CHECK(o.keep >= 0, "keep must be 0 (keep every checkpoint) or more, got ", o.keep);
  if (p.kind == Precision::Kind::fp8)
    OCTET_CHECK((o.batch * o.seq) % kTokenMultiple == 0, "FP8 GEMMs need batch*seq to be a ",
                "multiple of ", kTokenMultiple, ", got ", o.batch, "*", o.seq, " = ",
                o.batch * o.seq);
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

}  // namespace

StepResult train_step(TrainState& s, TokenSource& data, const TrainOptions& o, StepChecks& checks,
                      DataParallel& dp) {
  const int64_t step = s.step + 1;
  StepResult r;
  checks.begin_step(step);
  // The Linear weight gradients are overwritten by the first microbatch's wgrad GEMMs instead of
  // zeroed first (a 5.9 GB pass at GPT-2 1.5B); settle_grads() covers any that did not run.
  s.model->zero_grad(nn::ZeroGrad::on_next_write);
  // The rank's last backward starts the gradient buckets' reductions as it finishes them; an
  // injected gradient fault is written after the backward, so then they all start after it.
  GradientReadyHook* buckets = dp.gradient_hook(s.params, o.grad_bucket_mb);
  if (!o.inject.empty()) buckets = nullptr;
  {
    // The hook is the microbatches' only, also when one throws.
    struct HookReset {
      GPT& model;
      ~HookReset() { model.set_gradient_ready_hook(nullptr); }
    } hook_reset{*s.model};
    for (int64_t micro = 0; micro < o.accum; ++micro) {
      Batch b = data.next_batch(static_cast<int>(o.batch), static_cast<int>(o.seq));
      if (!dp.owns(micro, o.accum)) continue;  // another rank's: read only to keep the stream
      checks.before_microbatch(step, micro);
      if (dp.last_owned(micro, o.accum)) s.model->set_gradient_ready_hook(buckets);
      r.loss += s.model->train_microbatch(b.inputs.view({-1}), b.targets.view({-1}), o.batch,
                                          o.seq, 1.0f / static_cast<float>(o.accum));
      if (checks.guarding()) s.model->settle_grads();  // the guard reads them now
      checks.after_microbatch(step, micro);
    }
  }
  s.model->settle_grads();
  if (dp.active()) {
    // Each rank's gradients already carry 1/accum: their sum is the global batch's mean. With
    // buckets, this waits for the ones the backward started and reduces the rest.
    std::vector<Tensor> grads;
    grads.reserve(s.params.size());
    for (const Parameter& p : s.params) grads.push_back(p.grad);
    r.loss = dp.reduce_gradients(grads, r.loss);
  }
  r.loss /= static_cast<double>(o.accum);
  r.lr = learning_rate(o.lr, o.warmup, step);
  r.verdict = checks.finish(step, r.loss);  // reads the grad norm: the step's one host sync
  dp.agree(r.verdict);  // a rank's guard or injected fault skips the step everywhere
  s.step = step;
  if (r.verdict.skipped()) {
    // The next forward casts the weights again from the untouched masters with the restored
    // scales, exactly as this step's forward did.
    checks.restore_fp8();
    s.model->on_weights_updated(nn::PreparedCast::dropped);
    return r;
  }

  ops::AdamWArgs args;
  args.lr = static_cast<float>(r.lr);
  args.beta1 = kBeta1;
  args.beta2 = kBeta2;
  args.eps = kAdamEps;
  args.step = step;
  args.max_grad_norm = static_cast<float>(o.grad_clip);
  if (s.zero) {
    // Each rank updates its tensors (writing their next casts) and receives the others'.
    s.zero->step(s, checks.norm_sq(), args);
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
  ops::adamw_step(s.adamw.data(), static_cast<int>(s.adamw.size()), checks.norm_sq(), args);
  s.model->on_weights_updated(nn::PreparedCast::written);
  // The table keeps no cast: a handle here would keep the next step's next_casts() from writing
  // into this step's memory (Linear::prepare_next_cast).
  for (ops::AdamWTensor& t : s.adamw) {
    t.cast = nullptr;
    t.bf16_copy = Tensor();
  }
  return r;
}

TrainOptions resolve_defaults(TrainOptions o) {
  const bool gpu_visible = cuda_device_count() > 0;
  if (o.device == "auto") o.device = gpu_visible ? "cuda" : "cpu";
  const bool on_gpu = Device::parse_list(o.device).front().is_cuda();
  if (o.model.empty()) o.model = on_gpu ? "gpt2-124m" : "tiny";
  if (o.steps == 0) o.steps = on_gpu ? kGpuSteps : kCpuSteps;
  if (o.batch == 0) o.batch = on_gpu ? kGpuBatch : kCpuBatch;
  if (o.seq == 0) o.seq = on_gpu ? kGpuSeq : kCpuSeq;
  const int64_t width = o.dim ? o.dim : model_preset(o.model).dim;
  if (o.lr == 0) o.lr = default_learning_rate(width);
  if (o.warmup < 0) o.warmup = default_warmup(width);
  return o;
}

ModelConfig resolve_model_config(const TrainOptions& o, int data_vocab) {
  ModelConfig c = model_preset(o.model);
  if (o.layers) c.layers = o.layers;
  if (o.dim) c.dim = o.dim;
  if (o.heads) c.heads = o.heads;
  if (o.ffn) c.ffn = o.ffn;
  if (o.experts >= 0) c.experts = o.experts;
  const bool moe_flags = o.topk || o.moe_every || !o.moe_activation.empty() ||
                         o.aux_loss_coef >= 0 || !o.router.empty() || o.z_loss_coef >= 0 ||
                         o.shared_expert;
  OCTET_CHECK(c.experts > 0 || !moe_flags, "--topk, --act, --moe-every, --aux-loss-coef, --router, "
              "--z-loss-coef and --shared-expert configure mixture-of-experts layers; add "
              "--experts N (or --model moe-tiny)");
  if (o.topk) c.topk = o.topk;
  if (o.moe_every) c.moe_every = o.moe_every;
  if (!o.moe_activation.empty()) c.moe_activation = o.moe_activation;
  if (o.aux_loss_coef >= 0) c.aux_loss_coef = static_cast<float>(o.aux_loss_coef);
  if (!o.router.empty()) c.router = o.router;
  if (o.z_loss_coef >= 0) c.z_loss_coef = static_cast<float>(o.z_loss_coef);
  if (o.shared_expert) c.shared_expert = true;
  if (o.vocab) {
    c.vocab = o.vocab;
  } else if (data_vocab < c.vocab) {
    // A byte-level corpus needs no 50k-row embedding: use the data's vocabulary (rounded up to
    // the GEMM multiple) unless --vocab says otherwise.
    c.vocab = (data_vocab + kTokenMultiple - 1) / kTokenMultiple * kTokenMultiple;
  }
  // A longer --seq than the preset's: Llama has no position table; GPT-2's grows to --seq (new
  // rows drawn like the others), as a GPT-2 trained at a longer context would have.
  if (o.seq > c.max_seq) c.max_seq = o.seq;
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
  Device device;                ///< the first of `devices`
  std::vector<Device> devices;  ///< --device: one, or the stages of a split model
  Precision precision;
  std::unique_ptr<TokenSource> data;
  ModelConfig config;
  std::vector<nn::Fusion> unfused;  ///< --unfuse: off for the run
  std::optional<ops::AttentionChoice> attention;  ///< --attention, when given
};

/// The process-wide switches a run sets for its lifetime: --unfuse and --attention.
class RunSwitches {
 public:
  explicit RunSwitches(const RunSetup& run) : unfused_(run.unfused) {
    if (run.attention) attention_.emplace(*run.attention);
  }

 private:
  nn::UnfusedScope unfused_;
  std::optional<ops::ScopedAttentionChoice> attention_;
};

/// The precision named by o.precision with the recipe knobs of `o` applied (and checked).
Precision resolve_precision(const TrainOptions& o) {
  Precision p = Precision::from_name(o.precision);
  const bool knobs = o.amax_history != 0 || !o.amax_algo.empty() || o.margin >= 0;
  if (knobs) {
    OCTET_CHECK(p.kind == Precision::Kind::fp8 && p.recipe.kind == fp8::RecipeKind::delayed,
                "--amax-history, --amax-algo and --margin set delayed scaling's amax history and "
                "scale, but the precision is ",
                o.precision, "; use --precision fp8-delayed");
    if (o.amax_history != 0) {
      OCTET_CHECK(o.amax_history > 0 && o.amax_history <= INT32_MAX,
                  "--amax-history must be a positive row count, got ", o.amax_history);
      p.recipe.amax_history_len = static_cast<int>(o.amax_history);
    }
    if (!o.amax_algo.empty()) p.recipe.amax_compute_algo = fp8::amax_algo_from_name(o.amax_algo);
    if (o.margin >= 0) {
      OCTET_CHECK(o.margin <= 149, "--margin must be in [0, 149] (2^-margin must be a nonzero ",
                  "float), got ", o.margin);
      p.recipe.margin = static_cast<int>(o.margin);
    }
  }
  if (!o.fp8_format.empty()) {
    OCTET_CHECK(p.kind == Precision::Kind::fp8 && (p.recipe.kind == fp8::RecipeKind::delayed ||
                                                   p.recipe.kind == fp8::RecipeKind::current),
                "--fp8-format applies to fp8-delayed and fp8-current (block and MXFP8 recipes "
                "are E4M3), but the precision is ",
                o.precision);
    p.recipe.format = fp8::format_from_name(o.fp8_format);
  }
  if (p.kind == Precision::Kind::fp8) p.recipe.validate();
  return p;
}

/// "fp8-delayed (hybrid, amax history 1024 (max), margin 0)"; "bf16".
std::string describe_precision(const Precision& p) {
  return p.kind == Precision::Kind::fp8 ? p.name() + " (" + p.recipe.describe() + ")" : p.name();
}

RunSetup prepare_run(const TrainOptions& requested) {
  RunSetup run;
  run.options = resolve_defaults(requested);
  const TrainOptions& o = run.options;
  if (o.deterministic) set_deterministic(true);
  run.devices = Device::parse_list(o.device);
  for (const Device& d : run.devices) check_device_available(d);
  run.device = run.devices.front();
  run.precision = resolve_precision(o);
  run.unfused = nn::parse_fusions(o.unfuse.empty() ? "none" : o.unfuse);
  if (!o.attention.empty())
    run.attention = ops::parse_attention_choice(o.attention, "--attention");
  run.data = make_token_source(o.data, o.seed);
  run.config = resolve_model_config(o, run.data->vocab_size());
  check_run_shape(o, run.precision);
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

/// `value_on(device)` (bytes, allocations) added up over the devices, each device once: a split
/// model's whole footprint, which the by-kind figures (totals over the stages) add up to.
template <typename ValueOn>
uint64_t summed_over(const std::vector<Device>& devices, ValueOn value_on) {
  uint64_t total = 0;
  for (size_t i = 0; i < devices.size(); ++i)
    if (std::find(devices.begin(), devices.begin() + i, devices[i]) == devices.begin() + i)
      total += value_on(devices[i]);
  return total;
}

/// Bytes of AdamW moments this rank holds: its ZeRO-1 shard, or the whole m and v.
int64_t moment_bytes(const TrainState& s) {
  if (s.zero) return s.zero->moment_bytes();
  int64_t bytes = 0;
  for (const std::vector<Tensor>* moments : {&s.adam_m, &s.adam_v})
    for (const Tensor& t : *moments) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

/// This process's data-parallel group (one rank alone without a launcher), with the same options
/// checked on every rank before anything reads them; `placed` becomes the options on this rank's
/// devices (dist::devices_for_this_rank), whose kind picks the communicator (NCCL for GPU ranks,
/// MPI for CPU ranks).
DataParallel join_ranks(const TrainOptions& options, TrainOptions& placed) {
  placed = options;
  const std::string requested = resolve_defaults(options).device;
  const std::vector<Device> stages = dist::devices_for_this_rank(requested);
  placed.device = device_list_str(stages);
  DataParallel dp(dist::from_environment(stages.front()));
  dp.check_run(options);
  dp.set_grad_reduce_dtype(options.grad_reduce_dtype);
  return dp;
}

void train(const TrainOptions& options) {
  TrainOptions placed;
  DataParallel dp = join_ranks(options, placed);
  RunSetup run = prepare_run(placed);
  auto& [o, device, devices, precision, data, config, unfused, attention] = run;
  const RunSwitches switches(run);
  const bool root = dp.is_root();  // rank 0 prints, writes metrics, plots and checkpoints

  TrainState s =
      make_train_state(config, precision, devices, o.seed, o.recompute, dp.amax_reducer());

  fs::create_directories(o.out);
  std::optional<int64_t> resume_step;
  std::string resumed_from;
  if (!o.resume.empty()) {
    resumed_from = resolve_checkpoint(o.resume);
    const SafetensorsFile file = load_safetensors(resumed_from);
    const auto expected = run_metadata(o, config, precision, *data, 0);
    resume_step = resume_from(file, expected, s, *data);
    if (const auto change = rounding_change(file, expected); change && root)
      std::printf("octet train: note: %s\n", change->c_str());
    OCTET_CHECK(s.step < o.steps, "checkpoint ", resumed_from, " is at step ", s.step,
                ", nothing to do for --steps ", o.steps);
  }
  // After the restore: each rank keeps its shard of the (possibly resumed) moments.
  if (o.zero == 1) s.zero = std::make_shared<ZeroOptimizer>(dp.communicator(), s, o.weight_decay);
  dp.gradient_hook(s.params, o.grad_bucket_mb);  // the buckets, for the line below

  if (root) {
    std::printf("octet train: %s on %s, %s precision, data %s\n", config.describe().c_str(),
                device_list_str(devices).c_str(), describe_precision(precision).c_str(),
                data->describe().c_str());
    if (devices.size() > 1)
      std::printf(
          "  split into %zu stages of contiguous blocks (embeddings with the first, the "
          "head with the last)\n",
          devices.size());
    if (dp.active()) {
      char buckets[96];
      if (o.grad_bucket_mb == 0)
        std::snprintf(buckets, sizeof buckets, "gradients reduced after the backward");
      else
        std::snprintf(buckets, sizeof buckets, "%zu gradient bucket(s) of up to %g MiB",
                      dp.bucket_count(), o.grad_bucket_mb);
      std::printf(
          "  data parallel: world size %d (%s), %lld microbatch(es) per rank per step, %s\n",
          dp.size(), dp.describe().c_str(), (long long)(o.accum / dp.size()), buckets);
    }
    if (s.zero || o.grad_reduce_dtype != "fp32")
      std::printf("  zero %lld (AdamW moments per rank: %.1f MB%s), gradient reduction in %s\n",
                  (long long)o.zero, static_cast<double>(moment_bytes(s)) / 1e6,
                  s.zero ? "; the weights' FP32 masters on their owners only once a step has "
                           "written their casts"
                         : "",
                  o.grad_reduce_dtype.c_str());
    if (nn::disabled_fusions() != "none")
      std::printf("  fusions off: %s (bitwise the same results, slower)\n",
                  nn::disabled_fusions().c_str());
    if (device.is_cuda()) {
      const ops::AttentionChoice choice = ops::attention_choice();
      std::printf("  attention: %s (--attention or OCTET_ATTENTION: %s)\n",
                  ops::attention_choice_name(choice),
                  choice == ops::AttentionChoice::flash   ? "octet's own kernels"
                  : choice == ops::AttentionChoice::cudnn ? "cuDNN's fused SDPA only"
                                                          : "cuDNN's fused SDPA where it takes "
                                                            "the shape, else octet's kernels");
    }
    const std::string lr_origin =
        options.lr == 0 ? " (default for width " + std::to_string(config.dim) + ")" : "";
    std::printf(
        "  %lld steps x %lld microbatch(es) x %lld x %lld tokens, lr %g%s, warmup %lld, out %s%s\n",
        (long long)o.steps, (long long)o.accum, (long long)o.batch, (long long)o.seq, o.lr,
        lr_origin.c_str(), (long long)o.warmup, o.out.c_str(),
        resume_step
            ? (", resumed at step " + std::to_string(*resume_step) + " from " + resumed_from).c_str()
            : "");
    std::fflush(stdout);
  }

  const std::string metrics_path = (fs::path(o.out) / "metrics.jsonl").string();
  std::optional<MetricsWriter> metrics;
  std::optional<ProgressDisplay> progress;
  if (root) {
    metrics.emplace(metrics_path, resume_step);
    progress.emplace(o.steps, o.log_every);
  }
  dp.barrier();  // rank 0 has trimmed a resumed run's metrics before the others count its skips
  StepChecks checks(*s.model, s.params, o);
  const double tokens_per_step = static_cast<double>(o.batch * o.seq * o.accum);
  double first_loss = NAN, last_loss = NAN;
  // A resumed run goes on counting the skips its metrics hold.
  SkipLog skips(o.max_skips, count_true(metrics_path, "skipped"), root);
  fs::path checkpoint_path;
  int64_t saved_step = -1;
  auto save = [&] {
    // Under ZeRO every rank takes part in gathering the whole masters and moments, so the file is
    // the one a run without ZeRO writes, and resumes with or without it, on any number of ranks.
    if (s.zero) s.zero->gather(s);
    if (root)
      checkpoint_path = save_checkpoint(o.out, s.step, checkpoint_tensors(s),
                                        run_metadata(o, config, precision, *data, s.step), o.keep);
    if (s.zero) s.zero->release(s);
    saved_step = s.step;
  };
  auto intact_checkpoint = [&]() -> std::string {
    if (saved_step >= 0)
      return "the checkpoint " + checkpoint_path.string() + " (step " +
             std::to_string(saved_step) + ") is intact";
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
    const StepResult r = train_step(s, *data, o, checks, dp);
    const double loss = r.loss, grad_norm = r.verdict.grad_norm, lr = r.lr;
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    MetricFields fields{{"loss", loss},
                        {"grad_norm", grad_norm},
                        {"lr", lr},
                        {"tokens_per_s", tokens_per_step / seconds}};
    skips.record(step, r.verdict, loss, fields);  // also prints a line per skip and flag
    std::vector<Fp8LayerStats> fp8_stats;
    if (stats) {
      fp8_stats = s.model->fp8_layer_stats();
      // Under ZeRO a weight's cast is measured where its master is (collective).
      if (s.zero) fp8_stats = s.zero->share_weight_stats(s, std::move(fp8_stats));
    }
    if (root) {
      // The input and gradient statistics are rank 0's own casts (its share of the
      // microbatches); the weights' are every rank's.
      if (stats) fields.emplace_back("fp8", fp8_statistics(fp8_stats));
      if (config.experts > 0) fields.emplace_back("moe", moe_statistics(*s.model));
      // Evaluation reads the val split only; the replicas are identical, so rank 0's is the run's.
      if (o.eval_every > 0 && step % o.eval_every == 0 && step != o.steps)
        fields.emplace_back("val_loss",
                            validation_loss(*s.model, *data, o.batch, o.seq, o.eval_batches));
      metrics->write(step, fields);
      progress->update(step, loss, tokens_per_step / seconds);
    }
    if (std::isnan(first_loss)) first_loss = loss;
    if (!r.verdict.skipped()) last_loss = loss;
    // Every rank took the same verdicts, so every rank stops here (alone, trivially).
    if (skips.exhausted())
      throw dist::CollectiveError(__FILE__, __LINE__, skips.stop_message(step, intact_checkpoint()));
    // No checkpoint on a skipped step: the file on disk stays that of the last applied one.
    if (o.save_every > 0 && step % o.save_every == 0 && !r.verdict.skipped()) save();
  }
  if (saved_step != s.step) save();
  dp.barrier();  // the last checkpoint is on disk before any rank reports success
  if (!root) return;
  progress->finish();

  const double val = validation_loss(*s.model, *data, o.batch, o.seq, o.eval_batches);
  metrics->write(s.step, {{"val_loss", val}});
  std::printf("done: step %lld, train loss %.4f (first logged %.4f), val loss %.4f\n",
              (long long)s.step, last_loss, first_loss, val);
  if (o.data == "builtin" && config.vocab >= kByteVocab) {
    print_arithmetic_skill(*s.model);
  }
  if (s.zero) std::printf("%s\n", s.zero->describe(s).c_str());
  if (skips.total() > 0)
    std::printf("skipped steps: %lld (\"skipped\" in metrics.jsonl)\n", (long long)skips.total());
  std::printf("checkpoint: %s\n", checkpoint_path.c_str());
  const std::string png = (fs::path(o.out) / "loss.png").string();
  if (plot_loss(metrics->path(), png)) std::printf("loss plot: %s\n", png.c_str());
  std::printf("metrics: %s (%s tokens trained)\n", metrics->path().c_str(),
              human_count(tokens_per_step * static_cast<double>(o.steps)).c_str());
}

/// Under a launcher (mpirun, or torchrun's variables) every rank runs the steps as `octet train`
/// does; rank 0 reports: tokens/s of all ranks together (a step's batch x seq x accum tokens are
/// the whole group's) and its own device's memory.
void train_benchmark(const TrainOptions& options, int64_t warmup_steps, bool profile) {
  TrainOptions placed;
  DataParallel dp = join_ranks(options, placed);
  RunSetup run = prepare_run(placed);
  auto& [o, device, devices, precision, data, config, unfused, attention] = run;
  const RunSwitches switches(run);
  TrainState s =
      make_train_state(config, precision, devices, o.seed, o.recompute, dp.amax_reducer());
  if (o.zero == 1) s.zero = std::make_shared<ZeroOptimizer>(dp.communicator(), s, o.weight_decay);
  dp.gradient_hook(s.params, o.grad_bucket_mb);
  StepChecks checks(*s.model, s.params, o);
  // The peak from here on: what the steps hold, not the whole moments ZeRO has just released.
  for (const Device& d : devices) reset_device_peak(d);
  const double tokens_per_step = static_cast<double>(o.batch * o.seq * o.accum);
  std::vector<double> rates;
  double loss = 0;
  uint64_t plans_before_timing = 0;
  double planning_before_timing = 0;
  uint64_t allocations_before_timing = 0;
  for (int64_t i = 0; i < warmup_steps + o.steps; ++i) {
    if (i == warmup_steps) {
      plans_before_timing = ops::gemm_plans_made();
      planning_before_timing = ops::gemm_planning_seconds();
      allocations_before_timing = summed_over(devices, device_allocations);
    }
    if (profile && i == warmup_steps) profiler::set_enabled(true);
    const auto start = std::chrono::steady_clock::now();
    // Syncs at the grad-norm read; the AdamW it then launches is waited for by the next step.
    loss = train_step(s, *data, o, checks, dp).loss;
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i >= warmup_steps) rates.push_back(tokens_per_step / seconds);
  }
  const uint64_t timed_allocations =
      summed_over(devices, device_allocations) - allocations_before_timing;
  std::sort(rates.begin(), rates.end());
  const double median = rates[rates.size() / 2];
  if (profile) profiler::set_enabled(false);
  // The masters and moments of the rank that holds the most (every rank takes part).
  const int64_t held = master_bytes(s) + moment_bytes(s);
  Tensor most = Tensor::from_vector({static_cast<float>(held) / (1 << 30)}, {1});
  dp.communicator()->all_reduce(std::span(&most, 1), dist::ReduceOp::max);
  if (!dp.is_root()) return;
  if (profile) print_profile(profiler::collect(), o.steps, 1000.0 * tokens_per_step / median);
  const auto gib_of = [](auto bytes) { return static_cast<double>(bytes) / (1 << 30); };
  const auto gib = [&](const std::vector<Tensor>& tensors) {
    double bytes = 0;
    for (const Tensor& t : tensors) bytes += static_cast<double>(t.nbytes());
    return gib_of(bytes);
  };
  std::vector<Tensor> grads;
  for (const Parameter& p : s.params) grads.push_back(p.grad);
  TrainBenchResult result{config.preset,
                          precision.name(),
                          device_list_str(devices),
                          o.batch,
                          o.seq,
                          o.accum,
                          o.steps,
                          config.parameter_count(),
                          o.recompute,
                          median,
                          static_cast<double>(summed_over(devices, device_peak_bytes)) / (1 << 30),
                          loss,
                          {.weights = gib_of(master_bytes(s)),  // under ZeRO-1: kept here
                           .gradients = gib(grads),
                           .optimizer = gib_of(moment_bytes(s)),
                           .weight_casts = gib_of(s.model->weight_cast_bytes()),
                           .workspace = gib_of(summed_over(devices, ops::gemm_workspace_bytes))},
                          static_cast<int64_t>(ops::gemm_plans_made() - plans_before_timing),
                          1000.0 * (ops::gemm_planning_seconds() - planning_before_timing),
                          static_cast<double>(timed_allocations) / static_cast<double>(o.steps),
                          nn::disabled_fusions(),
                          ops::attention_choice_name(ops::attention_choice()),
                          dp.size(),
                          o.zero,
                          *most.data<float>()};
  print_train_bench(result);
}

}  // namespace

void run_train(const TrainOptions& options) {
  with_memory_advice(options, [&] { train(options); });
}

void run_train_benchmark(const TrainOptions& options, int64_t warmup_steps, bool profile) {
  with_memory_advice(options, [&] { train_benchmark(options, warmup_steps, profile); });
}

}  // namespace octet::train
