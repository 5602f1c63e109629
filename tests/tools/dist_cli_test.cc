// `mpirun -np 2 octet train` as a user runs it: data-parallel training on CPU ranks from the
// command line (rank 0 alone prints and writes), and its bad-input contract (one error per rank,
// a non-zero exit, no hang). Skips when mpirun or the MPI build is missing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "octet/dist/communicator.h"
#include "test_util.h"
#include "train/run_checks.h"
#include "train/scratch_dir.h"

namespace octet {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A run that hangs in a collective is a failure, not a stuck suite.
constexpr int kDeadlineSeconds = 120;
constexpr const char* kMpirun = "mpirun --allow-run-as-root --oversubscribe";
// The micro model of the CLI tests: a few steps in a second or two per rank on one core.
constexpr const char* kTiny =
    "train --device cpu --model tiny --layers 1 --dim 32 --heads 2 --ffn 64 --steps 3 "
    "--batch 2 --seq 16 --lr 3e-3 --warmup 1 --eval-batches 1 --seed 7";

using Result = testing::ShellResult;  ///< output: stdout and stderr

Result run(const std::string& command, const fs::path& dir) {
  return testing::run_shell("cd '" + dir.string() + "' && OMP_NUM_THREADS=1 timeout " +
                            std::to_string(kDeadlineSeconds) + " " + command + " 2>&1");
}

std::string octet(const std::string& args) {
  return std::string("'") + OCTET_CLI_PATH + "' " + args;
}
std::string on_two_ranks(const std::string& args) {
  return std::string(kMpirun) + " -np 2 " + octet(args);
}

bool have_mpirun() {
  return dist::built_with_mpi() && std::system("command -v mpirun >/dev/null 2>&1") == 0;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::vector<double> losses(const fs::path& metrics) {
  std::vector<double> out;
  for (const nlohmann::json& j : testing::step_lines(metrics))
    out.push_back(j["loss"].get<double>());
  return out;
}

/// Both runs logged `steps` losses, and from step `first` (1-based) on `metrics`' are within
/// `relative` of `reference`'s.
void expect_losses_near(const fs::path& metrics, const fs::path& reference, size_t steps,
                        size_t first, double relative) {
  const std::vector<double> a = losses(metrics), b = losses(reference);
  ASSERT_EQ(a.size(), steps);
  ASSERT_EQ(b.size(), steps);
  for (size_t i = first - 1; i < steps; ++i)
    EXPECT_NEAR(a[i], b[i], relative * b[i]) << "step " << i + 1;
}

TEST(DistCli, TwoRanksTrainLikeOneProcessWithTheSameAccum) {
  if (!have_mpirun()) GTEST_SKIP() << "needs mpirun and an MPI build";
  const fs::path dir = testing::scratch_dir();
  const std::string args = std::string(kTiny) + " --precision bf16 --accum 2";
  const Result dp = run(on_two_ranks(args + " --out dp"), dir);
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  EXPECT_EQ(count(dp.output, "octet train:"), 1u) << "one header: rank 0's\n" << dp.output;
  EXPECT_THAT(dp.output,
              HasSubstr("data parallel: world size 2 (mpi, 2 ranks), 1 microbatch(es) per rank"));
  EXPECT_EQ(count(dp.output, "done: step 3"), 1u) << dp.output;
  EXPECT_TRUE(fs::exists(dir / "dp" / "checkpoint-000003.safetensors"));

  const Result alone = run(octet(args + " --out alone"), dir);
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  // bf16, the same microbatches: only the FP32 summation order of the gradients and the loss
  // differs (tests/dist/data_parallel_test.cc has the reasoning); metrics print 9 digits.
  expect_losses_near(dir / "dp" / "metrics.jsonl", dir / "alone" / "metrics.jsonl", 3, 1, 1e-5);
}

/// kTiny with `from` replaced by `to`.
std::string tiny_with(const std::string& from, const std::string& to) {
  std::string args = kTiny;
  return args.replace(args.find(from), from.size(), to);
}

/// The launch failed on both ranks with `message` on one line each, hung on none, and trained
/// nothing into `out`.
void expect_refused_on_both_ranks(const Result& r, const std::string& message,
                                  const fs::path& out) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "timed out: a rank hung\n" << r.output;
  EXPECT_EQ(count(r.output, "octet: error: " + message), 2u) << r.output;
  EXPECT_FALSE(fs::exists(out / "metrics.jsonl")) << "nothing trained";
}

TEST(DistCli, RanksThatEachSplitTheModelTrainBitwiseLikeUnsplitRanksWithAndWithoutZero) {
  if (!have_mpirun()) GTEST_SKIP() << "needs mpirun and an MPI build";
  const fs::path dir = testing::scratch_dir();
  const std::string args =
      tiny_with("--layers 1", "--layers 2") + " --precision fp8-delayed --accum 2";
  const std::string split = tiny_with("--device cpu --model tiny --layers 1",
                                      "--device cpu,cpu --model tiny --layers 2") +
                            " --precision fp8-delayed --accum 2";
  ASSERT_EQ(run(on_two_ranks(args + " --out whole"), dir).exit_code, 0);
  // Each rank's model in two stages (both on its CPU): the same copies as on two GPUs.
  const Result halves = run(on_two_ranks(split + " --out split"), dir);
  ASSERT_EQ(halves.exit_code, 0) << halves.output;
  EXPECT_THAT(halves.output, HasSubstr("split into 2 stages"));
  EXPECT_THAT(halves.output, HasSubstr("data parallel: world size 2"));
  testing::expect_same_tensors(dir / "whole" / "checkpoint-000003.safetensors",
                               dir / "split" / "checkpoint-000003.safetensors");
  const Result zero = run(on_two_ranks(split + " --zero 1 --out zero"), dir);
  ASSERT_EQ(zero.exit_code, 0) << zero.output;
  testing::expect_same_tensors(dir / "whole" / "checkpoint-000003.safetensors",
                               dir / "zero" / "checkpoint-000003.safetensors");
}

TEST(DistCli, AResumedRunAndAOneProcessContinuationEqualTheUninterruptedRun) {
  if (!have_mpirun()) GTEST_SKIP() << "needs mpirun and an MPI build";
  const fs::path dir = testing::scratch_dir();
  const std::string args = std::string(kTiny) + " --precision fp8-delayed --accum 2";
  const std::string six = args.substr(0, args.find("--steps 3")) + "--steps 6" +
                          args.substr(args.find("--steps 3") + 9);
  ASSERT_EQ(run(on_two_ranks(six + " --out whole"), dir).exit_code, 0);
  ASSERT_EQ(run(on_two_ranks(args + " --out split"), dir).exit_code, 0);
  const Result resumed = run(on_two_ranks(six + " --out split --resume split"), dir);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  // Every rank restores the same checkpoint and data position: bitwise the uninterrupted run.
  testing::expect_same_tensors(dir / "whole" / "checkpoint-000006.safetensors",
                               dir / "split" / "checkpoint-000006.safetensors");
  // The data position does not depend on the world size, so one process with the same --accum
  // continues rank 0's checkpoint (the same microbatches; FP32 order and FP8 history differ).
  const Result alone =
      run(octet(six + " --out split --resume split/checkpoint-000003.safetensors"), dir);
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  // tests/dist/data_parallel_test.cc's fp8-delayed loss tolerance.
  expect_losses_near(dir / "split" / "metrics.jsonl", dir / "whole" / "metrics.jsonl", 6, 4, 5e-4);
}

TEST(DistCli, AZeroRunsCheckpointResumesWithoutZeroAndOneProcessesResumesOnTwoRanks) {
  if (!have_mpirun()) GTEST_SKIP() << "needs mpirun and an MPI build";
  const fs::path dir = testing::scratch_dir();
  const std::string args = std::string(kTiny) + " --precision bf16 --accum 2";
  const std::string six = args.substr(0, args.find("--steps 3")) + "--steps 6" +
                          args.substr(args.find("--steps 3") + 9);
  ASSERT_EQ(run(on_two_ranks(six + " --out whole"), dir).exit_code, 0);
  // ZeRO-1 is bitwise the run without it, and its checkpoint holds the whole moments.
  const Result zero = run(on_two_ranks(args + " --zero 1 --out zero"), dir);
  ASSERT_EQ(zero.exit_code, 0) << zero.output;
  EXPECT_THAT(zero.output, HasSubstr("zero 1 (AdamW moments per rank:"));
  ASSERT_EQ(run(on_two_ranks(args + " --out plain"), dir).exit_code, 0);
  testing::expect_same_tensors(dir / "zero" / "checkpoint-000003.safetensors",
                               dir / "plain" / "checkpoint-000003.safetensors");
  // 2 ranks (ZeRO) -> 1 process without ZeRO; 1 process -> 2 ranks with ZeRO.
  const Result one =
      run(octet(six + " --out zero --resume zero/checkpoint-000003.safetensors"), dir);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  expect_losses_near(dir / "zero" / "metrics.jsonl", dir / "whole" / "metrics.jsonl", 6, 4, 1e-5);
  ASSERT_EQ(run(octet(args + " --out single"), dir).exit_code, 0);
  const Result two = run(on_two_ranks(six + " --zero 1 --out single --resume single"), dir);
  ASSERT_EQ(two.exit_code, 0) << two.output;
  expect_losses_near(dir / "single" / "metrics.jsonl", dir / "whole" / "metrics.jsonl", 6, 4,
                     1e-5);
}

TEST(DistCli, Bf16GradientReductionTrainsCloseToFp32) {
  if (!have_mpirun()) GTEST_SKIP() << "needs mpirun and an MPI build";
  const fs::path dir = testing::scratch_dir();
  const std::string args = std::string(kTiny) + " --precision bf16 --accum 2";
  ASSERT_EQ(run(on_two_ranks(args + " --out f32"), dir).exit_code, 0);
  const Result bf16 = run(on_two_ranks(args + " --grad-reduce-dtype bf16 --out bf16"), dir);
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  // Step 1's loss is computed before any reduction: the same. Later steps see gradients off by
  // up to 3 * 2^-8 of their magnitude (communicator_test.cc's bound for 2 ranks), which AdamW's
  // normalized update turns into weight changes of a small fraction of lr per step: 1e-3.
  expect_losses_near(dir / "bf16" / "metrics.jsonl", dir / "f32" / "metrics.jsonl", 3, 1, 1e-3);
  const Result bad = run(on_two_ranks(args + " --grad-reduce-dtype fp16 --out x"), dir);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_EQ(count(bad.output, "--grad-reduce-dtype takes fp32 or bf16, got 'fp16'"), 2u)
      << bad.output;
}

TEST(DistCli, ARankThatDiesOrHangsMidRunEndsTheOthersWithAnError) {
  if (!have_mpirun()) GTEST_SKIP() << "needs mpirun and an MPI build";
  const fs::path dir = testing::scratch_dir();
  // Rank 1 owns microbatch 1 of each step (--accum 2): it exits, or hangs, at step 2. Rank 0
  // then waits in the step's gradient reduction until mpirun ends it (a rank that exited) or its
  // watchdog's deadline of 3 s passes (a rank that hangs).
  for (const std::string fault : {"exit", "hang"}) {
    SCOPED_TRACE(fault);
    const auto start = std::chrono::steady_clock::now();
    const Result r = run(std::string("env OCTET_COLLECTIVE_TIMEOUT_S=3 ") +
                             on_two_ranks(std::string(kTiny) + " --accum 2 --inject " + fault +
                                          "@2:1 --out " + fault),
                         dir);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.exit_code, 124) << "timed out: a rank hung\n" << r.output;
    EXPECT_LT(seconds, 60) << r.output;
    EXPECT_THAT(r.output, HasSubstr("injected fault: this process " + fault +
                                    "s at step 2, microbatch 1"));
    if (fault == "hang")
      EXPECT_THAT(r.output, HasSubstr("octet: error: rank 0 of 2: the collective all_reduce did "
                                      "not complete within 3 s"));
    EXPECT_FALSE(fs::exists(dir / fault / "checkpoint-000003.safetensors"));
  }
}

TEST(DistCli, MismatchedOptionsFailOnEveryRankWithoutHanging) {
  if (!have_mpirun()) GTEST_SKIP() << "needs mpirun and an MPI build";
  const fs::path dir = testing::scratch_dir();
  // MPMD: one command line per rank.
  const std::string args = std::string(kTiny) + " --accum 2 --precision bf16 --out x";
  const Result r = run(std::string(kMpirun) + " -np 1 " + octet(args) + " : -np 1 " +
                           octet(args + " --grad-clip 0.5"),
                       dir);
  expect_refused_on_both_ranks(
      r, "the 2 ranks were not given the same options (rank 1's differ from rank 0's)", dir / "x");
}

TEST(DistCli, AnAccumTheWorldSizeDoesNotDivideFailsOnEveryRank) {
  if (!have_mpirun()) GTEST_SKIP() << "needs mpirun and an MPI build";
  const fs::path dir = testing::scratch_dir();
  const Result r = run(on_two_ranks(std::string(kTiny) + " --accum 3 --out x"), dir);
  expect_refused_on_both_ranks(r,
                               "--accum 3 counts the microbatches of a step over all 2 ranks, so "
                               "it must be a multiple of the world size 2",
                               dir / "x");
}

TEST(DistCli, BenchTrainOnTwoRanksReportsTheGroupOnceWithItsZeroShare) {
  if (!have_mpirun()) GTEST_SKIP() << "needs mpirun and an MPI build";
  const fs::path dir = testing::scratch_dir();
  // Wide enough that the moments (about 0.8M parameters, 6 MB) show in the GiB figures.
  const std::string bench =
      "bench train --device cpu --model tiny --layers 1 --dim 256 --heads 4 --ffn 512 --batch 2 "
      "--seq 16 --accum 2 --steps 2 --warmup-steps 1 --precision bf16";
  const Result dp = run(on_two_ranks(bench), dir);
  ASSERT_EQ(dp.exit_code, 0) << dp.output;
  EXPECT_EQ(count(dp.output, "{\"bench\":\"train\""), 1u) << "rank 0 alone reports\n" << dp.output;
  const nlohmann::json plain = testing::bench_train_line(dp.output);
  ASSERT_FALSE(plain.empty()) << dp.output;
  EXPECT_EQ(plain["world_size"], 2);
  EXPECT_EQ(plain["zero"], 0);
  EXPECT_GT(plain["tokens_per_s"].get<double>(), 0.0);

  const Result zero = run(on_two_ranks(bench + " --zero 1"), dir);
  ASSERT_EQ(zero.exit_code, 0) << zero.output;
  const nlohmann::json sharded = testing::bench_train_line(zero.output);
  ASSERT_FALSE(sharded.empty()) << zero.output;
  EXPECT_EQ(sharded["zero"], 1);
  // Rank 0 holds the moments of its whole tensors, a part of them (zero_test.cc checks the
  // shares).
  const double whole = plain["peak_by_kind_gib"]["optimizer"].get<double>();
  ASSERT_GT(whole, 0.004) << "the moments must be large enough to compare";
  EXPECT_GT(sharded["peak_by_kind_gib"]["optimizer"].get<double>(), 0.2 * whole);
  EXPECT_LT(sharded["peak_by_kind_gib"]["optimizer"].get<double>(), 0.8 * whole);
  // After the warm-up step the other rank's Linear weights (BF16 casts written by their owner)
  // have no FP32 master here (zero.h); the gradients stay whole.
  EXPECT_LT(sharded["peak_by_kind_gib"]["weights"].get<double>(),
            plain["peak_by_kind_gib"]["weights"].get<double>());
  EXPECT_EQ(sharded["peak_by_kind_gib"]["gradients"], plain["peak_by_kind_gib"]["gradients"]);
  // The rank holding the most masters and moments: at least rank 0's, and less than every rank
  // held without ZeRO (its masters and moments are rank 0's).
  const double most = sharded["masters_and_moments_max_gib"].get<double>();
  EXPECT_GE(most, sharded["peak_by_kind_gib"]["weights"].get<double>() +
                      sharded["peak_by_kind_gib"]["optimizer"].get<double>() - 1e-4);
  EXPECT_NEAR(plain["masters_and_moments_max_gib"].get<double>(),
              plain["peak_by_kind_gib"]["weights"].get<double>() + whole, 2e-4);
  EXPECT_LT(most, 0.75 * plain["masters_and_moments_max_gib"].get<double>());

  const Result alone = run(octet(bench), dir);
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  EXPECT_EQ(testing::bench_train_line(alone.output)["world_size"], 1);
}

}  // namespace
}  // namespace octet
