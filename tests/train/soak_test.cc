// The CPU soak: the tiny FP8 model with activation recompute and the gradient guard, trained for
// 300 steps in six runs that each resume the checkpoint of the one before (every 50 steps).
// The loss stays finite and falls, metrics.jsonl holds every step exactly once in order, no step
// is skipped or flagged, and the process's resident memory does not grow from run to run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <thread>
#include <vector>

#include "octet/train/trainer.h"
#include "train/run_checks.h"
#include "train/scratch_dir.h"

namespace octet::train {
namespace {

constexpr int64_t kSegments = 6, kSegmentSteps = 50;
/// How far the peak resident memory of a later run may exceed the second run's. The first run is
/// the baseline's warm-up (OpenMP's threads, allocator arenas, the data); from the second on
/// every run allocates and frees the same model, so a leak of the model's state (about 8 MiB:
/// weights, gradients, two moments and the casts of 0.45M parameters) or of 40 KiB per step
/// shows as growth of that order from run 2 to any later run, well past this allowance for the
/// allocator's page-level noise.
constexpr double kRssAllowanceMiB = 3.0;

/// Resident memory of this process in MiB (/proc/self/statm's second field, in pages).
double resident_mib() {
  long pages = 0, resident = 0;
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  const int read = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  if (read != 2) return 0;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) /
         (1024.0 * 1024.0);
}

/// Samples resident_mib() every few milliseconds while it lives; peak() is the largest seen.
class RssSampler {
 public:
  RssSampler()
      : thread_([this] {
          while (!stop_) {
            peak_ = std::max(peak_.load(), resident_mib());
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
        }) {}
  ~RssSampler() {
    stop_ = true;
    thread_.join();
  }
  double peak() const { return std::max(peak_.load(), resident_mib()); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<double> peak_{0.0};
  std::thread thread_;
};

double mean(const std::vector<double>& v, size_t begin, size_t end) {
  return std::accumulate(v.begin() + begin, v.begin() + end, 0.0) /
         static_cast<double>(end - begin);
}

TEST(Soak, TinyFp8RecomputeResumedEvery50StepsStaysFiniteContinuousAndFlat) {
  const uint64_t seed = octet::testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const auto dir = octet::testing::scratch_dir() / "run";
  TrainOptions o;
  o.device = "cpu";
  o.precision = "fp8-delayed";
  o.model = "tiny";
  o.data = octet::testing::corpus_beside(dir);
  o.batch = 4;
  o.seq = 32;
  o.accum = 2;
  o.recompute = true;
  o.seed = seed;
  o.save_every = kSegmentSteps;
  o.eval_batches = 1;
  o.out = dir.string();
  o.guard = true;

  std::vector<double> peaks;
  for (int64_t segment = 1; segment <= kSegments; ++segment) {
    o.steps = segment * kSegmentSteps;
    o.resume = segment == 1 ? "" : (dir / "checkpoint.safetensors").string();
    RssSampler rss;
    run_train(o);
    peaks.push_back(rss.peak());
  }

  const auto lines = octet::testing::step_lines(dir / "metrics.jsonl");
  ASSERT_EQ(static_cast<int64_t>(lines.size()), kSegments * kSegmentSteps);
  std::vector<double> losses;
  double max_z = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(lines[i]["step"], static_cast<int64_t>(i) + 1);
    EXPECT_FALSE(lines[i].contains("skipped")) << lines[i];
    EXPECT_FALSE(lines[i].contains("guard")) << lines[i];
    ASSERT_TRUE(lines[i].contains("guard_z")) << lines[i];
    max_z = std::max(max_z, lines[i]["guard_z"].get<double>());
    ASSERT_TRUE(lines[i]["loss"].is_number()) << lines[i];
    losses.push_back(lines[i]["loss"].get<double>());
    EXPECT_TRUE(std::isfinite(losses.back()));
  }
  // Falling: the last 25 steps' mean loss well under the first 25's (ln 256 = 5.5 at the start).
  EXPECT_LT(mean(losses, losses.size() - 25, losses.size()), 0.7 * mean(losses, 0, 25));

  std::printf(
      "soak: loss %.3f over the first 25 steps, %.3f over the last 25; largest guard z %.2f\n",
      mean(losses, 0, 25), mean(losses, losses.size() - 25, losses.size()), max_z);
  for (size_t i = 0; i < peaks.size(); ++i)
    std::printf("soak: run %zu peak resident memory %.1f MiB\n", i + 1, peaks[i]);
  for (size_t i = 2; i < peaks.size(); ++i)
    EXPECT_LE(peaks[i], peaks[1] + kRssAllowanceMiB) << "run " << i + 1;
}

}  // namespace
}  // namespace octet::train
