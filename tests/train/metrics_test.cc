#include "octet/train/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "octet/core/error.h"
#include "test_util.h"
#include "train/scratch_dir.h"

namespace octet::train {
namespace {

using octet::testing::error_of;
using octet::testing::fresh_seed;
using octet::testing::read_file;
using octet::testing::scratch_dir;
using ::testing::HasSubstr;

void append_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::app);
  out << text;
}

std::string printf_g(double value, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*g", digits, value);
  return buffer;
}

/// A finite double with random bits (every exponent and mantissa is equally likely).
double random_double(std::mt19937_64& rng) {
  for (;;) {
    const double d = std::bit_cast<double>(rng());
    if (std::isfinite(d)) return d;
  }
}

float random_float(std::mt19937_64& rng) {
  for (;;) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (std::isfinite(f)) return f;
  }
}

// ----------------------------------------------------------------------------
// Numbers

TEST(MetricsNumbers, RandomDoublesRoundTripBitwise) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  int short_form = 0;
  for (int i = 0; i < 30000; ++i) {
    // Random bits; short decimals (the %.9g form reads back); float results widened to double
    // (they need %.17g as doubles).
    const double value = i % 3 == 0   ? random_double(rng)
                         : i % 3 == 1 ? double(rng() % 100000) / 1000.0
                                      : double(float(rng() % 100000) / 7919.0f);
    const std::string text = format_double(value);
    ASSERT_EQ(std::bit_cast<uint64_t>(std::strtod(text.c_str(), nullptr)),
              std::bit_cast<uint64_t>(value))
        << text;
    // As a JSON reader sees it.
    const double parsed = nlohmann::json::parse(metrics_line(1, {{"x", value}}))["x"].get<double>();
    ASSERT_EQ(std::bit_cast<uint64_t>(parsed), std::bit_cast<uint64_t>(value)) << text;
    // "%.9g" whenever it is exact, "%.17g" otherwise.
    const std::string g9 = printf_g(value, 9);
    if (std::strtod(g9.c_str(), nullptr) == value) {
      ASSERT_EQ(text, g9);
      ++short_form;
    } else {
      ASSERT_EQ(text, printf_g(value, 17));
    }
  }
  EXPECT_GE(short_form, 30000 / 3);
  EXPECT_EQ(format_double(0.1), "0.1");
  EXPECT_EQ(format_double(2.0), "2");
  EXPECT_EQ(format_double(1.0 / 3.0), "0.33333333333333331");
  EXPECT_EQ(format_double(-0.0), "-0.0");
}

TEST(MetricsNumbers, RandomFloatsPrintWithPercentNineG) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 30000; ++i) {
    const float value = random_float(rng);
    const std::string text = format_float(value);
    if (value != 0 || !std::signbit(value)) ASSERT_EQ(text, printf_g(value, 9));
    ASSERT_EQ(std::bit_cast<uint32_t>(std::strtof(text.c_str(), nullptr)),
              std::bit_cast<uint32_t>(value))
        << text;
    // Read as a double (as JSON readers do), then narrowed: still the same float.
    const double parsed = nlohmann::json::parse(metrics_line(1, {{"x", value}}))["x"].get<double>();
    ASSERT_EQ(std::bit_cast<uint32_t>(static_cast<float>(parsed)), std::bit_cast<uint32_t>(value));
  }
  EXPECT_EQ(format_float(0.1f), "0.100000001");
}

TEST(MetricsNumbers, NonFiniteValuesBecomeStrings) {
  EXPECT_EQ(format_double(NAN), "\"NaN\"");
  EXPECT_EQ(format_double(INFINITY), "\"Infinity\"");
  EXPECT_EQ(format_double(-INFINITY), "\"-Infinity\"");
  EXPECT_EQ(format_float(-INFINITY), "\"-Infinity\"");
  const auto j = nlohmann::json::parse(metrics_line(3, {{"loss", NAN}, {"grad_norm", INFINITY}}));
  EXPECT_EQ(j["loss"], "NaN");
  EXPECT_EQ(j["grad_norm"], "Infinity");
}

// ----------------------------------------------------------------------------
// Lines

TEST(MetricsLine, FieldsInOrderWithNestedStatistics) {
  nlohmann::json fp8;
  fp8["layers.0.fc1"] = {
      {"amax", 0.1}, {"scale", 4480.0}, {"saturated", 0}, {"hist", {1.5, 1e-40}}};
  fp8["layers.0.fc2"] = {{"amax", 1.0 / 3.0}, {"flag", true}, {"note", nullptr}};
  const std::string line = metrics_line(42, {{"loss", 2.5f},
                                             {"lr", 3e-4},
                                             {"tokens", int64_t{9007199254740993}},
                                             {"recipe", "delayed \"hybrid\"\n"},
                                             {"fp8", fp8}});
  EXPECT_EQ(line, R"({"step":42,"loss":2.5,"lr":0.0003,"tokens":9007199254740993,)"
                  R"("recipe":"delayed \"hybrid\"\n","fp8":{"layers.0.fc1":{"amax":0.1,)"
                  R"("hist":[1.5,1e-40],"saturated":0,"scale":4480},)"
                  R"("layers.0.fc2":{"amax":0.33333333333333331,"flag":true,"note":null}}})");
  const auto parsed = nlohmann::json::parse(line);
  EXPECT_EQ(parsed["fp8"], fp8);  // every nested number read back exactly
  EXPECT_EQ(parsed["tokens"].get<int64_t>(), 9007199254740993);
}

TEST(MetricsLine, RejectsDuplicateKeys) {
  EXPECT_THAT(error_of([] {
                metrics_line(1, {{"loss", 1.0}, {"loss", 2.0}});
              }),
              HasSubstr("metric 'loss' given twice"));
  EXPECT_THAT(error_of([] {
                metrics_line(1, {{"step", 1}});
              }),
              HasSubstr("metric 'step' given twice (or named 'step'"));
}

// ----------------------------------------------------------------------------
// The writer and resume

MetricFields step_fields(int64_t step, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> loss(1.0, 5.0);
  return {{"loss", loss(rng)}, {"lr", 1e-3 * double(step)}, {"phase", "train"}};
}

TEST(MetricsWriter, WritesAndFlushesEachLine) {
  const auto path = scratch_dir() / "metrics.jsonl";
  append_file(path, "{\"step\":99}\n");  // a fresh run starts the file empty
  MetricsWriter writer(path.string());
  writer.write(1, {{"loss", 2.0}});
  EXPECT_EQ(read_file(path), "{\"step\":1,\"loss\":2}\n");  // visible before the writer closes
  writer.write(2, {{"loss", 1.5}});
  EXPECT_EQ(read_file(path), "{\"step\":1,\"loss\":2}\n{\"step\":2,\"loss\":1.5}\n");
}

TEST(MetricsWriter, ResumedRunEqualsUninterruptedRun) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const auto dir = scratch_dir();
  constexpr int64_t kSteps = 30, kCheckpoint = 17, kCrash = 23;
  const auto run = [&](const std::filesystem::path& path, int64_t from, int64_t to,
                       std::optional<int64_t> resume) {
    MetricsWriter writer(path.string(), resume);
    for (int64_t step = from; step <= to; ++step) {
      std::mt19937_64 rng(seed + step);  // each step's values depend only on the step
      writer.write(step, step_fields(step, rng));
      if (step % 5 == 0) writer.write(step, {{"val_loss", 0.5 + 1.0 / double(step)}});
    }
  };
  const auto whole = dir / "whole.jsonl", resumed = dir / "resumed.jsonl";
  run(whole, 1, kSteps, std::nullopt);
  // Interrupted: ran past the checkpoint, then crashed in the middle of a line.
  run(resumed, 1, kCrash, std::nullopt);
  append_file(resumed, "{\"step\":24,\"lo");
  run(resumed, kCheckpoint + 1, kSteps, kCheckpoint);
  EXPECT_EQ(read_file(resumed), read_file(whole));
}

TEST(MetricsWriter, ResumeKeepsLinesUpToTheStepAndRejectsGarbage) {
  const auto dir = scratch_dir();
  const auto path = dir / "m.jsonl";
  append_file(path,
              "{\"step\":1,\"loss\":3}\n{\"note\":\"no step\"}\n{\"step\":2,\"loss\":2}\n"
              "{\"step\":3,\"loss\":1}\n");
  { MetricsWriter writer(path.string(), 2); }
  EXPECT_EQ(read_file(path),
            "{\"step\":1,\"loss\":3}\n{\"note\":\"no step\"}\n{\"step\":2,\"loss\":2}\n");
  append_file(path, "not json\n");
  EXPECT_THAT(error_of([&] { MetricsWriter writer(path.string(), 2); }),
              HasSubstr("line 4 is not valid JSON: 'not json'"));
  // Resuming without a file starts one.
  { MetricsWriter writer((dir / "new.jsonl").string(), 5); }
  EXPECT_TRUE(std::filesystem::exists(dir / "new.jsonl"));
  EXPECT_THAT(error_of([&] { MetricsWriter writer((dir / "no" / "m.jsonl").string()); }),
              HasSubstr("cannot open metrics file"));
}

// ----------------------------------------------------------------------------
// Progress

TEST(Progress, FormatsStepLossRateAndEta) {
  EXPECT_EQ(format_progress(120, 1000, 2.34567, 12345, 83, 10),
            "[#.........] step 120/1000 | loss 2.3457 | 12.3k tok/s | ETA 1m23s");
  EXPECT_EQ(format_progress(1000, 1000, 0.5, 2.5e6, 0),
            "step 1000/1000 | loss 0.5000 | 2.50M tok/s | ETA 0s");
  EXPECT_EQ(format_progress(1, 4, 9.0, 512, NAN, 4),
            "[#...] step 1/4 | loss 9.0000 | 512 tok/s | ETA ?");
  EXPECT_EQ(format_duration(59.4), "59s");
  EXPECT_EQ(format_duration(187), "3m07s");
  EXPECT_EQ(format_duration(7500), "2h05m");
  EXPECT_EQ(format_duration(-1), "?");
}

std::string captured(std::FILE* file) {
  std::fflush(file);
  std::rewind(file);
  std::string out;
  for (int c; (c = std::fgetc(file)) != EOF;) out += static_cast<char>(c);
  return out;
}

TEST(Progress, PlainOutputEveryNSteps) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  {
    ProgressDisplay progress(25, 10, file);  // a file is not a terminal
    EXPECT_FALSE(progress.terminal());
    for (int64_t step = 1; step <= 25; ++step) progress.update(step, 1.0, 100);
  }
  const std::string out = captured(file);
  std::fclose(file);
  std::vector<std::string> lines;
  for (size_t begin = 0, end; (end = out.find('\n', begin)) != std::string::npos; begin = end + 1)
    lines.push_back(out.substr(begin, end - begin));
  ASSERT_EQ(lines.size(), 4u) << out;
  EXPECT_THAT(lines[0], HasSubstr("step 1/25 |"));
  EXPECT_THAT(lines[1], HasSubstr("step 10/25 |"));
  EXPECT_THAT(lines[2], HasSubstr("step 20/25 |"));
  EXPECT_THAT(lines[3], HasSubstr("step 25/25 |"));
  EXPECT_EQ(out.find('\r'), std::string::npos);
}

TEST(Progress, TerminalRedrawsOneLine) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  {
    ProgressDisplay progress(3, 10, file, ProgressDisplay::Mode::terminal);
    progress.update(1, 2.0, 10);
    progress.update(2, 1.5, 10);
    progress.message("val loss 1.2");
    progress.update(3, 1.0, 10);
  }
  const std::string out = captured(file);
  std::fclose(file);
  const std::string bar3 = "[" + std::string(30, '#') + "] step 3/3";
  EXPECT_THAT(out, HasSubstr("\r[##########....................] step 1/3 | loss 2.0000"));
  EXPECT_THAT(out, HasSubstr("\r\x1b[Kval loss 1.2\n"));
  EXPECT_THAT(out, HasSubstr("\r" + bar3));
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 2) << out;  // the message and finish()
  EXPECT_EQ(out.back(), '\n');
}

// ----------------------------------------------------------------------------
// Plot

bool gnuplot_installed() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

TEST(PlotLoss, DrawsAPngWithGnuplot) {
  if (!gnuplot_installed()) GTEST_SKIP() << "gnuplot is not installed";
  const auto dir = scratch_dir();
  const auto metrics = dir / "metrics.jsonl";
  {
    MetricsWriter writer(metrics.string());
    for (int64_t step = 1; step <= 50; ++step) {
      writer.write(step, {{"loss", step == 7 ? NAN : 4.0 / std::sqrt(double(step))}});
      if (step % 10 == 0) writer.write(step, {{"val_loss", 4.2 / std::sqrt(double(step))}});
    }
  }
  const auto png = dir / "it's the loss.png";  // a quote in the name must survive gnuplot
  ASSERT_TRUE(plot_loss(metrics.string(), png.string()));
  const std::string bytes = read_file(png);
  ASSERT_GT(bytes.size(), 1000u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
}

TEST(PlotLoss, FalseWithoutGnuplotAndErrorsWithoutLoss) {
  const auto dir = scratch_dir();
  const auto metrics = dir / "metrics.jsonl";
  append_file(metrics, "{\"step\":1,\"lr\":0.1}\n");
  const std::string saved_path = std::getenv("PATH") ? std::getenv("PATH") : "";
  ::setenv("PATH", dir.c_str(), 1);  // a folder without gnuplot
  const bool plotted = plot_loss(metrics.string(), (dir / "x.png").string());
  ::setenv("PATH", saved_path.c_str(), 1);
  EXPECT_FALSE(plotted);
  EXPECT_FALSE(std::filesystem::exists(dir / "x.png"));
  if (!gnuplot_installed()) GTEST_SKIP() << "gnuplot is not installed";
  EXPECT_THAT(error_of([&] { plot_loss(metrics.string(), (dir / "x.png").string()); }),
              HasSubstr("has no numeric 'loss' values"));
}

}  // namespace
}  // namespace octet::train
