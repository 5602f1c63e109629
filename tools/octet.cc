// The octet command: train, eval, generate, inspect, bench train, info.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <string>

#include "octet/core/device.h"
#include "octet/core/error.h"
#include "octet/dist/communicator.h"
#include "octet/train/commands.h"
#include "octet/train/trainer.h"

namespace {

/// One clear line on stderr for a failure (the message carries any remedy).
int report(const std::string& message) {
  std::fprintf(stderr, "octet: error: %s\n", message.c_str());
  return 1;
}

/// A number above (or at least) zero. CLI11's own range validators print the limits of a double;
/// these say the rule and the value. A value that is no number passes on to the conversion,
/// whose error names the type expected.
CLI::Validator at_least_zero(bool strictly) {
  const std::string rule = strictly ? "> 0" : ">= 0";
  return CLI::Validator(
      [strictly, rule](std::string& text) -> std::string {
        double value = 0;
        try {
          value = std::stod(text);
        } catch (const std::exception&) {
          return {};
        }
        if (strictly ? value > 0 : value >= 0) return {};
        return "must be " + rule + ", got " + text;
      },
      rule);
}
const CLI::Validator kPositive = at_least_zero(true);
const CLI::Validator kNonNegative = at_least_zero(false);

void add_train_options(CLI::App* cmd, octet::train::TrainOptions& o) {
  cmd->add_option("--device", o.device,
                  "cpu, cuda or cuda:N (default: cuda when a GPU is visible); a list such as "
                  "cuda:0,1 splits the model's blocks over those GPUs in one process");
  cmd->add_option("--precision", o.precision,
                  "fp8-delayed, fp8-current, fp8-block, fp8-mxfp8, bf16 or fp32")
      ->capture_default_str();
  cmd->add_option("--amax-history", o.amax_history,
                  "fp8-delayed: amax history rows (TE amax_history_len; default 1024)");
  cmd->add_option("--amax-algo", o.amax_algo,
                  "fp8-delayed: max or most_recent (TE amax_compute_algo; default max)");
  cmd->add_option("--margin", o.margin,
                  "fp8-delayed: scales divided by 2^M (TE margin; default 0)");
  cmd->add_option("--fp8-format", o.fp8_format,
                  "fp8-delayed/-current: hybrid (E4M3 forward, E5M2 gradients) or e4m3 (TE "
                  "fp8_format; default hybrid)");
  cmd->add_option("--unfuse", o.unfuse,
                  "switch fused casts off: all, or a comma list of norm-cast, activation-cast, "
                  "activation-grad-cast, bias-grad, optimizer-cast, moe-activation-cast, "
                  "input-recast (bitwise the same results; to bisect a numerical difference; "
                  "input-recast off keeps the FP8 Linear inputs for backward: faster, more "
                  "memory)");
  cmd->add_option("--attention", o.attention,
                  "attention on CUDA: auto (cuDNN's fused SDPA where it takes the shape, else "
                  "octet's kernels), cudnn or flash (octet's kernels); all deterministic "
                  "(default: OCTET_ATTENTION, else auto)");
  cmd->add_option("--model", o.model,
                  "tiny, gpt2-124m, gpt2-350m, gpt2-1.5b, llama-1b, moe-tiny or moe-16x2048 "
                  "(default: tiny on CPU, gpt2-124m on GPU)");
  cmd->add_option("--layers", o.layers, "override the preset's layer count")->check(kPositive);
  cmd->add_option("--dim", o.dim, "override the model width")->check(kPositive);
  cmd->add_option("--heads", o.heads, "override the number of attention heads")->check(kPositive);
  cmd->add_option("--ffn", o.ffn, "override the MLP hidden width")->check(kPositive);
  cmd->add_option("--vocab", o.vocab, "override the vocabulary size (a multiple of 16)")
      ->check(kPositive);
  cmd->add_option("--experts", o.experts,
                  "mixture of experts: experts per MoE layer (0: dense; default: the preset's)")
      ->check(kNonNegative);
  cmd->add_option("--topk", o.topk, "MoE: experts per token (default 2)")->check(kPositive);
  cmd->add_option("--act", o.moe_activation,
                  "MoE: the experts' activation: swiglu, geglu, srelu or gelu (default swiglu)");
  cmd->add_option("--moe-every", o.moe_every,
                  "MoE: every L-th layer is an MoE layer (1: all, 2: every second; default 1)")
      ->check(kPositive);
  cmd->add_option("--aux-loss-coef", o.aux_loss_coef,
                  "MoE: load-balancing loss weight (0: off; default 0.01)")
      ->check(kNonNegative);
  cmd->add_option("--router", o.router,
                  "MoE: the router's scoring: softmax (Mixtral) or sigmoid (DeepSeek-V3; "
                  "default softmax)");
  cmd->add_option("--z-loss-coef", o.z_loss_coef, "MoE: router z-loss weight (0: off; default 0)")
      ->check(kNonNegative);
  cmd->add_flag("--shared-expert", o.shared_expert,
                "MoE: add a dense MLP of width ffn that every token also goes through");
  cmd->add_option("--data", o.data, "builtin, text:FILE or bin:GLOB (llm.c shards)")
      ->capture_default_str();
  cmd->add_option("--steps", o.steps, "optimizer steps")->check(kPositive);
  cmd->add_option("--batch", o.batch, "sequences per microbatch")->check(kPositive);
  cmd->add_option("--seq", o.seq, "tokens per sequence")->check(kPositive);
  cmd->add_option("--accum", o.accum, "microbatches per optimizer step")->capture_default_str();
  cmd->add_option("--lr", o.lr,
                  "peak learning rate (default: by the model's width, from the GPT-3 table)")
      ->check(kPositive);
  cmd->add_option(
         "--warmup", o.warmup,
         "warmup steps (default: by the model's width, 20 at tiny to 200 from gpt2-124m up)")
      ->check(kNonNegative);
  cmd->add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->capture_default_str();
  cmd->add_option("--grad-clip", o.grad_clip, "global grad-norm clip (0: off)")
      ->capture_default_str();
  cmd->add_option("--zero", o.zero,
                  "ZeRO stage under mpirun: 1 shards the AdamW moments and, under bf16 and "
                  "fp8-delayed, the weights' FP32 masters over the ranks (bitwise the same "
                  "results)")
      ->capture_default_str();
  cmd->add_option("--grad-reduce-dtype", o.grad_reduce_dtype,
                  "dtype of the gradient all-reduce across ranks: fp32 or bf16 (half the bytes)")
      ->capture_default_str();
  cmd->add_option("--grad-bucket-mb", o.grad_bucket_mb,
                  "MiB of gradients per all-reduce bucket, each started as soon as the backward "
                  "has finished it (0: one all-reduce after the backward)")
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "seed of weights and data order")->capture_default_str();
  cmd->add_flag("--recompute", o.recompute, "recompute activations in backward (saves memory)");
  cmd->add_flag("--deterministic", o.deterministic,
                "bitwise reproducible runs; ops without a deterministic path refuse to run");
  cmd->add_option("--out", o.out, "output directory")->capture_default_str();
  cmd->add_option("--save-every", o.save_every, "checkpoint every N steps (0: at the end)");
  cmd->add_option("--keep", o.keep, "checkpoints kept in --out, newest first (0: all)")
      ->capture_default_str();
  cmd->add_option("--resume", o.resume,
                  "continue bitwise from a checkpoint file or a run directory (its newest)");
  cmd->add_option("--eval-every", o.eval_every, "val loss every N steps (0: at the end)");
  cmd->add_option("--eval-batches", o.eval_batches, "val batches per evaluation")
      ->capture_default_str();
  cmd->add_option("--fp8-stats-every", o.fp8_stats_every,
                  "FP8 statistics into metrics.jsonl every N steps (0: never)")
      ->capture_default_str();
  cmd->add_option("--log-every", o.log_every, "progress line every N steps off a terminal")
      ->capture_default_str();
  cmd->add_option("--max-skips", o.max_skips,
                  "stop after N skipped (non-finite) steps in a row (0: never)")
      ->capture_default_str();
  cmd->add_flag("--guard", o.guard,
                "flag layers whose gradient norm leaves its running band (metrics.jsonl)");
  cmd->add_flag("--guard-skip", o.guard_skip, "--guard, and skip the flagged steps");
  cmd->add_option("--guard-z", o.guard_z, "z-score above the band that flags")
      ->capture_default_str();
  cmd->add_option("--guard-warmup", o.guard_warmup, "steps that build the band before it flags")
      ->capture_default_str();
  cmd->add_option("--inject", o.inject,
                  "testing aid: faults to inject, KIND@STEPS[:MICROBATCH][/LAYER] (see "
                  "docs/RELIABILITY.md)");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"octet: FP8 training engine for transformer models"};
  app.require_subcommand(1);

  octet::train::TrainOptions train_options;
  auto* train = app.add_subcommand("train", "train a GPT-style model from random initialization");
  add_train_options(train, train_options);

  std::string checkpoint, device = "auto", prompt = "12+34=";
  int64_t batches = 8, tokens = 64;
  double temperature = 0.8;
  uint64_t seed = 1;
  auto* eval =
      app.add_subcommand("eval", "val loss (and builtin arithmetic accuracy) of a checkpoint");
  eval->add_option("checkpoint", checkpoint, "a checkpoint file or a run directory")->required();
  eval->add_option("--device", device, "cpu, cuda or cuda:N");
  eval->add_option("--batches", batches, "val batches")->capture_default_str();
  auto* generate = app.add_subcommand("generate", "sample text from a checkpoint");
  generate->add_option("checkpoint", checkpoint, "a checkpoint file or a run directory")
      ->required();
  generate->add_option("--device", device, "cpu, cuda or cuda:N");
  generate->add_option("--prompt", prompt, "text to continue")->capture_default_str();
  generate->add_option("--tokens", tokens, "tokens to generate")->capture_default_str();
  generate->add_option("--temperature", temperature, "0 for greedy")->capture_default_str();
  generate->add_option("--seed", seed, "sampling seed")->capture_default_str();
  auto* inspect = app.add_subcommand("inspect", "print a checkpoint's config and FP8 state");
  inspect->add_option("checkpoint", checkpoint, "a checkpoint file or a run directory")->required();
  octet::train::TrainOptions bench_options;
  bench_options.steps = 10;
  int64_t bench_warmup = 3;
  bool bench_profile = false;
  auto* bench =
      app.add_subcommand("bench", "benchmarks (kernel benchmarks: the octet_bench binary)");
  bench->require_subcommand(1);
  auto* bench_train = bench->add_subcommand(
      "train", "training throughput and peak memory: one JSON line (median tokens/s)");
  add_train_options(bench_train, bench_options);
  bench_train->add_option("--warmup-steps", bench_warmup, "untimed steps first")
      ->capture_default_str();
  bench_train->add_flag("--profile", bench_profile,
                        "time every op on the device and print where a step goes (stderr)");
  auto* info = app.add_subcommand("info", "print the build and the visible GPUs");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "octet: error: %s (see octet --help)\n", e.what());
    return 2;
  }

  try {
    if (train->parsed()) octet::train::run_train(train_options);
    if (bench_train->parsed())
      octet::train::run_train_benchmark(bench_options, bench_warmup, bench_profile);
    if (eval->parsed()) octet::train::run_eval(checkpoint, device, batches);
    if (generate->parsed())
      octet::train::run_generate(checkpoint, device, prompt, tokens, temperature, seed);
    if (inspect->parsed()) octet::train::run_inspect(checkpoint);
    if (info->parsed())
      std::printf("octet 0.1.0, CUDA backend %s, %d GPU(s) visible\n",
                  octet::built_with_cuda() ? "on" : "off", octet::cuda_device_count());
  } catch (const octet::dist::CollectiveError& e) {
    // Every rank raised it together: MPI ends cleanly everywhere.
    report(e.message());
    octet::dist::shutdown(true);
    return 1;
  } catch (const octet::Error& e) {
    // Perhaps this rank alone: the others could wait in a collective forever, so under MPI this
    // ends them all (no-op otherwise).
    report(e.message());
    octet::dist::shutdown(false);
    return 1;
  } catch (const std::exception& e) {
    report(e.what());
    octet::dist::shutdown(false);
    return 1;
  }
  octet::dist::shutdown(true);
  return 0;
}
