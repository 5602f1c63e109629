// The checkpoint side of training: CRC-32C per tensor, the checkpoints of a run directory (keep,
// newest, links, interrupted saves), resuming from a directory, extending a run, the default
// learning rate and warmup, and a checkpoint whose metadata lies about the model.
#include "octet/train/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "octet/core/error.h"
#include "octet/train/commands.h"
#include "octet/train/crc32c.h"
#include "octet/train/schedule.h"
#include "octet/train/trainer.h"
#include "test_util.h"
#include "train/micro_run.h"
#include "train/scratch_dir.h"

namespace octet::train {
namespace {

namespace fs = std::filesystem;
using octet::testing::error_of;
using octet::testing::fresh_seed;
using octet::testing::loss_lines;
using octet::testing::micro_options;
using octet::testing::read_file;
using octet::testing::rewrite_metadata;
using octet::testing::same_checkpoint_tensors;
using octet::testing::scratch_dir;
using ::testing::HasSubstr;
using ::testing::Not;

void write_bytes(const fs::path& path, const std::string& bytes) {
  fs::remove(path);
  std::ofstream(path, std::ios::binary) << bytes;
}

/// Small random f32 tensors named like a checkpoint's ("param.a", ...).
std::vector<std::pair<std::string, Tensor>> random_tensors(std::mt19937_64& rng) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const char* name : {"param.a", "param.b", "adam_m.a", "fp8.x.fwd.scale"}) {
    Tensor t = Tensor::empty({3 + static_cast<int64_t>(rng() % 5), 7}, DType::f32);
    for (int64_t i = 0; i < t.numel(); ++i)
      t.data<float>()[i] = static_cast<float>(static_cast<int64_t>(rng() % 2001) - 1000) / 64.0f;
    out.emplace_back(name, t);
  }
  return out;
}

/// The file names in `dir`, sorted.
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& entry : fs::directory_iterator(dir)) out.push_back(entry.path().filename());
  std::sort(out.begin(), out.end());
  return out;
}

// ----------------------------------------------------------------------------
// CRC-32C

TEST(Crc32c, MatchesTheRfc3720Vectors) {
  // RFC 3720 appendix B.4 (the CRC's bytes there are little-endian) and the common check value.
  const std::string check = "123456789";
  EXPECT_EQ(crc32c(check.data(), check.size()), 0xE3069283u);
  std::array<uint8_t, 32> bytes{};
  EXPECT_EQ(crc32c(bytes.data(), bytes.size()), 0x8A9136AAu);
  bytes.fill(0xFF);
  EXPECT_EQ(crc32c(bytes.data(), bytes.size()), 0x62A8AB43u);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(crc32c(bytes.data(), bytes.size()), 0x46DD794Eu);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(31 - i);
  EXPECT_EQ(crc32c(bytes.data(), bytes.size()), 0x113FDB5Cu);
  EXPECT_EQ(crc32c(bytes.data(), 0), 0u);
}

TEST(Crc32c, HardwareAndPortablePathsAgreeAndContinue) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> data(4099);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  for (int trial = 0; trial < 64; ++trial) {
    const size_t begin = rng() % 64, length = rng() % (data.size() - begin);
    const uint32_t whole = crc32c(data.data() + begin, length);
    EXPECT_EQ(whole, crc32c_portable(data.data() + begin, length)) << begin << "+" << length;
    const size_t split = length ? rng() % length : 0;
    EXPECT_EQ(whole, crc32c(data.data() + begin + split, length - split,
                            crc32c(data.data() + begin, split)));
  }
}

// ----------------------------------------------------------------------------
// Checksums in checkpoints

TEST(CheckpointChecksum, EveryTensorRecordsItsCrc) {
  std::mt19937_64 rng(fresh_seed());
  const auto tensors = random_tensors(rng);
  const fs::path path = scratch_dir() / "c.safetensors";
  save_safetensors(path.string(), tensors, {{"note", "x"}});
  const SafetensorsFile file = load_safetensors(path.string());
  for (const auto& [name, t] : tensors) {
    char expected[9];
    std::snprintf(expected, sizeof expected, "%08x", crc32c(t.raw_data(), t.nbytes()));
    EXPECT_EQ(file.metadata().at(kChecksumPrefix + name), expected) << name;
  }
}

TEST(CheckpointChecksum, AFlippedBitNamesItsTensor) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const auto dir = scratch_dir();
  const auto tensors = random_tensors(rng);
  save_safetensors((dir / "good.safetensors").string(), tensors, {});
  const std::string good = read_file(dir / "good.safetensors");
  uint64_t header = 0;
  for (int i = 0; i < 8; ++i) header |= uint64_t{static_cast<uint8_t>(good[i])} << (8 * i);
  const size_t data_start = 8 + header;
  for (int trial = 0; trial < 24; ++trial) {
    std::string bad = good;
    const size_t at = data_start + rng() % (good.size() - data_start);
    bad[at] = static_cast<char>(bad[at] ^ (1 << (rng() % 8)));
    const fs::path path = dir / "bad.safetensors";
    write_bytes(path, bad);
    const SafetensorsFile file = load_safetensors(path.string());  // the header is intact
    int failures = 0;
    for (const auto& [name, t] : tensors) {
      try {
        file.get(name);
      } catch (const Error& e) {
        ++failures;
        EXPECT_THAT(e.message(), HasSubstr("is corrupt: tensor '" + name + "' has CRC-32C"));
        EXPECT_EQ(e.message().find('\n'), std::string::npos);
      }
    }
    EXPECT_EQ(failures, 1) << "byte " << at;
  }
}

TEST(CheckpointChecksum, MissingOrMalformedChecksumsAreRefusedAndVersion1StillReads) {
  std::mt19937_64 rng(fresh_seed());
  const auto dir = scratch_dir();
  const auto tensors = random_tensors(rng);
  const fs::path good = dir / "good.safetensors";
  save_safetensors(good.string(), tensors, {});
  const std::string bytes = read_file(good);
  auto with_header_edit = [&](const std::string& from, const std::string& to) {
    std::string edited = bytes;
    const size_t at = edited.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    edited.replace(at, from.size(), to);  // same length: offsets stay valid
    const fs::path path = dir / "edited.safetensors";
    write_bytes(path, edited);
    return path.string();
  };
  const std::string key = std::string(kChecksumPrefix) + "param.b";
  // A renamed checksum key: param.b has none, and the key names no tensor.
  EXPECT_THAT(error_of([&] {
                load_safetensors(with_header_edit(key, key.substr(0, key.size() - 1) + "z"));
              }),
              HasSubstr("expected 8 hex digits naming a tensor of the file"));
  // A checksum that is not hex.
  const SafetensorsFile file = load_safetensors(good.string());
  const std::string crc = file.metadata().at(key);
  EXPECT_THAT(error_of([&] { load_safetensors(with_header_edit(crc, "zzzzzzzz")); }),
              HasSubstr("'zzzzzzzz' expected 8 hex digits"));
  // Version 2 without one checksum: the key renamed to an unrelated note.
  EXPECT_THAT(
      error_of([&] { load_safetensors(with_header_edit(key, "octet_other." + key.substr(12))); }),
      HasSubstr("tensor 'param.b' has no octet_crc32c. metadata"));
  // Version 1 files (before checksums) still read, their tensors unchecked.
  std::string v1 = bytes;
  for (const auto& [name, t] : tensors) {
    const std::string k = kChecksumPrefix + name;
    v1.replace(v1.find(k), k.size(), "octet_other." + k.substr(12));
  }
  v1.replace(v1.find("\"octet_format_version\":\"2\""), 26, "\"octet_format_version\":\"1\"");
  write_bytes(dir / "v1.safetensors", v1);
  const SafetensorsFile old = load_safetensors((dir / "v1.safetensors").string());
  for (const auto& [name, t] : tensors) EXPECT_EQ(old.get(name).nbytes(), t.nbytes());
}

// ----------------------------------------------------------------------------
// The checkpoints of a run directory

TEST(CheckpointDir, KeepsTheNewestKAndLinksTheNewest) {
  std::mt19937_64 rng(fresh_seed());
  const auto dir = scratch_dir() / "run";
  const auto tensors = random_tensors(rng);
  for (int64_t step = 1; step <= 5; ++step) save_checkpoint(dir, step, tensors, {}, 2);
  EXPECT_EQ(names_in(dir),
            (std::vector<std::string>{"checkpoint-000004.safetensors",
                                      "checkpoint-000005.safetensors", "checkpoint.safetensors"}));
  EXPECT_EQ(fs::read_symlink(dir / "checkpoint.safetensors"), "checkpoint-000005.safetensors");
  EXPECT_EQ(newest_checkpoint(dir), dir / "checkpoint-000005.safetensors");
  EXPECT_EQ(resolve_checkpoint(dir.string()), (dir / "checkpoint-000005.safetensors").string());

  // --keep 0 keeps all; --keep 1 only the newest.
  save_checkpoint(dir, 6, tensors, {}, 0);
  EXPECT_EQ(list_checkpoints(dir).size(), 3u);
  save_checkpoint(dir, 7, tensors, {}, 1);
  ASSERT_EQ(list_checkpoints(dir).size(), 1u);
  EXPECT_EQ(list_checkpoints(dir)[0].step, 7);

  // A save at an earlier step (a run resumed from there) replaces the later checkpoints.
  save_checkpoint(dir, 8, tensors, {}, 3);
  save_checkpoint(dir, 3, tensors, {}, 3);
  ASSERT_EQ(list_checkpoints(dir).size(), 1u);
  EXPECT_EQ(list_checkpoints(dir)[0].step, 3);
  EXPECT_EQ(fs::read_symlink(dir / "checkpoint.safetensors"), "checkpoint-000003.safetensors");
}

TEST(CheckpointDir, InterruptedSavesAreIgnoredAndCleanedAndDamagedNewestIsPassedOver) {
  std::mt19937_64 rng(fresh_seed());
  const auto dir = scratch_dir() / "run";
  const auto tensors = random_tensors(rng);
  save_checkpoint(dir, 1, tensors, {}, 0);
  save_checkpoint(dir, 2, tensors, {}, 0);
  // What a crash mid-save leaves: a temporary file of another process, half written.
  const std::string full = read_file(dir / "checkpoint-000002.safetensors");
  write_bytes(dir / "checkpoint-000003.safetensors.tmp.999999", full.substr(0, full.size() / 2));
  write_bytes(dir / "checkpoint.safetensors.tmp.999998", "");
  write_bytes(dir / "metrics.jsonl.tmp.999997", "{\"step\":");
  EXPECT_EQ(newest_checkpoint(dir), dir / "checkpoint-000002.safetensors");
  // A damaged newest file (written by something else than a save) is passed over.
  write_bytes(dir / "checkpoint-000009.safetensors", full.substr(0, 100));
  EXPECT_EQ(newest_checkpoint(dir), dir / "checkpoint-000002.safetensors");
  fs::remove(dir / "checkpoint-000009.safetensors");
  save_checkpoint(dir, 3, tensors, {}, 0);
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{
                               "checkpoint-000001.safetensors", "checkpoint-000002.safetensors",
                               "checkpoint-000003.safetensors", "checkpoint.safetensors"}));
}

TEST(CheckpointDir, ResolvesFilesDirectoriesAndTheOldLayout) {
  std::mt19937_64 rng(fresh_seed());
  const auto dir = scratch_dir();
  fs::create_directories(dir / "empty");
  EXPECT_THAT(error_of([&] { resolve_checkpoint((dir / "empty").string()); }),
              HasSubstr("holds no complete checkpoint (checkpoint-<step>.safetensors)"));
  // A run directory of an older octet: one regular checkpoint.safetensors.
  fs::create_directories(dir / "old");
  save_safetensors((dir / "old" / "checkpoint.safetensors").string(), random_tensors(rng), {});
  EXPECT_EQ(resolve_checkpoint((dir / "old").string()),
            (dir / "old" / "checkpoint.safetensors").string());
  EXPECT_EQ(resolve_checkpoint("some/file.safetensors"), "some/file.safetensors");
}

TEST(CheckpointDir, AFailedWriteNamesTheNewestCompleteCheckpoint) {
  std::mt19937_64 rng(fresh_seed());
  const auto dir = scratch_dir() / "run";
  const auto tensors = random_tensors(rng);
  save_checkpoint(dir, 1, tensors, {}, 2);
  const std::string before = read_file(dir / "checkpoint-000001.safetensors");
  // A directory where the next checkpoint's temporary file must go makes its creation fail.
  fs::create_directories(dir / ("checkpoint-000002.safetensors.tmp." + std::to_string(::getpid())));
  const std::string message = error_of([&] { save_checkpoint(dir, 2, tensors, {}, 2); });
  EXPECT_THAT(message, HasSubstr("checkpoint of step 2 not saved"));
  EXPECT_THAT(message, HasSubstr("the newest complete checkpoint is " +
                                 (dir / "checkpoint-000001.safetensors").string()));
  EXPECT_THAT(message, HasSubstr("--resume " + dir.string()));
  EXPECT_EQ(read_file(dir / "checkpoint-000001.safetensors"), before);
}

// ----------------------------------------------------------------------------
// Resuming and extending runs

TEST(CheckpointResume, FromARunDirectoryAndExtendedWithMoreStepsEqualsOneRun) {
  const auto dir = scratch_dir();
  // Default warmup (20) and learning rate: the settings that depended on --steps before.
  TrainOptions whole = micro_options(dir / "whole", "fp8-delayed");
  whole.warmup = -1;
  whole.lr = 0;
  whole.steps = 9;
  run_train(whole);

  TrainOptions first = whole;
  first.out = (dir / "split").string();
  first.steps = 6;
  first.save_every = 3;
  run_train(first);
  TrainOptions second = first;
  second.steps = 9;
  second.resume = first.out;  // the directory: its newest checkpoint (step 6)
  ::testing::internal::CaptureStdout();
  run_train(second);
  const std::string header = ::testing::internal::GetCapturedStdout();
  EXPECT_THAT(header, HasSubstr("lr 0.002 (default for width 32), warmup 20"));
  EXPECT_THAT(header, HasSubstr("resumed at step 6 from " +
                                (dir / "split" / "checkpoint-000006.safetensors").string()));

  ASSERT_EQ(loss_lines(dir / "whole" / "metrics.jsonl").size(), 9u);
  EXPECT_EQ(loss_lines(dir / "split" / "metrics.jsonl"),
            loss_lines(dir / "whole" / "metrics.jsonl"));
  EXPECT_TRUE(same_checkpoint_tensors(dir / "whole" / "checkpoint-000009.safetensors",
                                      dir / "split" / "checkpoint-000009.safetensors"));
  // --keep 2 (the default): checkpoints 6 and 9 remain of 3, 6 and 9.
  EXPECT_EQ(list_checkpoints(dir / "split").size(), 2u);
}

/// A two-step run of `precision` into dir/run; returns its options, for a resume.
TrainOptions two_steps_into(const fs::path& dir, const std::string& precision) {
  TrainOptions o = micro_options(dir / "run", precision);
  o.steps = 2;
  run_train(o);
  return o;
}

TEST(CheckpointResume, SaysWhenTheCheckpointWasWrittenUnderOtherRoundings) {
  const auto dir = scratch_dir();
  const TrainOptions first = two_steps_into(dir, "fp8-delayed");
  const fs::path written = dir / "run" / "checkpoint.safetensors";
  EXPECT_EQ(load_safetensors(written.string()).metadata().at("rounding"), "cpu");

  const auto resume_output = [&](const fs::path& from) {
    TrainOptions more = first;
    more.out = (dir / ("more-" + from.stem().string())).string();
    more.steps = 3;
    more.resume = from.string();
    ::testing::internal::CaptureStdout();
    run_train(more);
    return ::testing::internal::GetCapturedStdout();
  };
  EXPECT_THAT(resume_output(written), Not(HasSubstr("note:"))) << "the same roundings";
  // A checkpoint from a GPU run: the continuation on the CPU says it is not bitwise that run's.
  const fs::path from_gpu = dir / "from-gpu.safetensors";
  rewrite_metadata(written, from_gpu, "rounding", "cuda, attention flash");
  EXPECT_THAT(resume_output(from_gpu),
              HasSubstr("note: checkpoint " + from_gpu.string() + " was written on cuda, "
                        "attention flash, this run is on cpu: the continuation is deterministic, "
                        "but not bitwise the uninterrupted run"));
}

TEST(CheckpointResume, ACorruptTensorStopsTheResumeNamingIt) {
  const auto dir = scratch_dir();
  TrainOptions o = two_steps_into(dir, "bf16");
  const fs::path ckpt = dir / "run" / "checkpoint-000002.safetensors";
  std::string bytes = read_file(ckpt);
  bytes[bytes.size() - 3] = static_cast<char>(bytes[bytes.size() - 3] ^ 0x10);  // last tensor
  write_bytes(ckpt, bytes);
  const SafetensorsFile file = load_safetensors(ckpt.string());
  const std::string last = file.names().back();
  o.steps = 4;
  o.resume = (dir / "run").string();
  EXPECT_THAT(error_of([&] { run_train(o); }), HasSubstr("tensor '" + last + "' has CRC-32C"));
}

// ----------------------------------------------------------------------------
// Defaults that scale with the model, and do not depend on --steps

TEST(TrainDefaults, LearningRateFollowsTheGpt3TableByWidth) {
  EXPECT_EQ(default_learning_rate(128), 2e-3);
  EXPECT_EQ(default_learning_rate(64), 2e-3);
  EXPECT_EQ(default_learning_rate(768), 6e-4);
  EXPECT_EQ(default_learning_rate(1024), 3e-4);
  EXPECT_EQ(default_learning_rate(2048), 2e-4);
  EXPECT_EQ(default_learning_rate(12288), 0.6e-4);
  EXPECT_EQ(default_learning_rate(65536), 0.6e-4);
  const double gpt2_xl = default_learning_rate(1600);
  EXPECT_LT(gpt2_xl, 2.5e-4);
  EXPECT_GT(gpt2_xl, 2e-4);
  for (int64_t width = 16; width < 20000; width += 16)
    EXPECT_LE(default_learning_rate(width + 16), default_learning_rate(width)) << width;

  // What `octet train` resolves: the 14-layer x 2048 model that diverged on 6e-4 gets 2e-4.
  TrainOptions o;
  o.device = "cpu";
  o.model = "gpt2-124m";
  EXPECT_EQ(resolve_defaults(o).lr, 6e-4);
  o.layers = 14;
  o.dim = 2048;
  o.heads = 16;
  EXPECT_EQ(resolve_defaults(o).lr, 2e-4);
  o.lr = 1e-3;  // given: kept
  EXPECT_EQ(resolve_defaults(o).lr, 1e-3);
  o = TrainOptions{};
  o.device = "cpu";
  EXPECT_EQ(resolve_defaults(o).lr, 2e-3);  // tiny (width 128): the CPU main job's rate
  o.model = "llama-1b";
  EXPECT_EQ(resolve_defaults(o).lr, 2e-4);
}

TEST(TrainDefaults, WarmupDependsOnTheModelNotOnSteps) {
  TrainOptions o;
  o.device = "cpu";
  for (int64_t steps : {1, 6, 9, 20, 1000}) {
    o.steps = steps;
    EXPECT_EQ(resolve_defaults(o).warmup, 20) << steps;  // tiny
  }
  o.model = "gpt2-124m";
  EXPECT_EQ(resolve_defaults(o).warmup, 200);
  o.model = "gpt2-1.5b";
  EXPECT_EQ(resolve_defaults(o).warmup, 200);
  o.warmup = 7;  // given: kept
  EXPECT_EQ(resolve_defaults(o).warmup, 7);
  EXPECT_EQ(default_warmup(64), 20);
  EXPECT_EQ(default_warmup(128), 20);
  EXPECT_EQ(default_warmup(384), 82);  // between the rows: log-linear
  EXPECT_EQ(default_warmup(768), 200);
  EXPECT_EQ(default_warmup(4096), 200);
}

// ----------------------------------------------------------------------------
// A checkpoint whose metadata lies about the model

TEST(CheckpointHostile, AConfigLargerThanTheTensorsIsRefusedBeforeAllocating) {
  const auto dir = scratch_dir();
  TrainOptions o = micro_options(dir / "run", "fp8-delayed");
  o.steps = 1;
  run_train(o);
  const fs::path good = dir / "run" / "checkpoint-000001.safetensors";
  std::string config = load_safetensors(good.string()).metadata().at("config");
  // 4096 layers of width 16384 (about 13T parameters, 50 TB in FP32) over a 20k-parameter file.
  config.replace(config.find("\"layers\":1"), 10, "\"layers\":4096");
  config.replace(config.find("\"dim\":32"), 8, "\"dim\":16384");
  const fs::path lying = dir / "lying.safetensors";
  rewrite_metadata(good, lying, "config", config);
  const std::string message = error_of([&] { run_eval(lying.string(), "cpu", 1); });
  EXPECT_THAT(message, HasSubstr("parameters; the metadata does not match the tensors"));
  EXPECT_THAT(message, HasSubstr("hold 20896 parameters"));
  EXPECT_THAT(error_of([&] { run_generate(lying.string(), "cpu", "1+1=", 4, 0, 1); }),
              HasSubstr("does not match the tensors"));

  // Batch and sequence sizes beyond what the token sources count are refused before evaluating.
  rewrite_metadata(good, lying, "batch", "1000000000000");
  EXPECT_THAT(error_of([&] { run_eval(lying.string(), "cpu", 1); }),
              HasSubstr("got batch 1000000000000, seq 16"));
  rewrite_metadata(good, lying, "seq", "99999999999999999999999");
  EXPECT_THAT(error_of([&] { run_eval(lying.string(), "cpu", 1); }),
              HasSubstr("metadata 'seq' expected an integer"));
}

}  // namespace
}  // namespace octet::train
