#include "train/run_checks.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>

#include "octet/train/safetensors.h"
#include "train/scratch_dir.h"

namespace octet::testing {

std::string corpus_beside(const std::filesystem::path& out) {
  const std::filesystem::path path = out.parent_path() / "corpus.txt";
  if (!std::filesystem::exists(path)) {
    // Words drawn from a fixed generator: learnable, and the same in every run.
    const char* const words[] = {"the ",   "scale ", "of ",   "an ",    "amax ",
                                 "is ",    "kept ",  "when ", "a ",     "step ",
                                 "skips ", "and ",   "loss ", "falls ", "\n"};
    std::mt19937 rng(20240520);
    std::ofstream file(path);
    for (int i = 0; i < 6000; ++i) file << words[rng() % std::size(words)];
  }
  return "text:" + path.string();
}

train::TrainOptions micro_run(const std::filesystem::path& out, const std::string& device,
                              const std::string& precision) {
  train::TrainOptions o;
  o.data = corpus_beside(out);
  o.device = device;
  o.precision = precision;
  o.model = "tiny";
  o.layers = 1;
  o.dim = 32;
  o.heads = 2;
  o.ffn = 64;
  o.steps = 6;
  o.batch = 2;
  o.seq = 16;
  o.accum = 2;
  o.lr = 3e-3;
  o.warmup = 2;
  o.out = out.string();
  o.eval_batches = 1;
  o.fp8_stats_every = 0;
  return o;
}

std::vector<nlohmann::json> step_lines(const std::filesystem::path& metrics) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(read_file(metrics));
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss")) lines.push_back(std::move(j));
  }
  return lines;
}

nlohmann::json bench_train_line(const std::string& output) {
  const size_t line = output.rfind("{\"bench\"");
  if (line == std::string::npos) return nlohmann::json::object();
  return nlohmann::json::parse(output.substr(line, output.find('\n', line) - line));
}

void expect_same_tensors(const std::filesystem::path& expected,
                         const std::filesystem::path& actual) {
  train::SafetensorsFile a = train::load_safetensors(expected.string());
  train::SafetensorsFile b = train::load_safetensors(actual.string());
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& name : a.names()) {
    const Tensor ta = a.get(name), tb = b.get(name);
    ASSERT_EQ(ta.nbytes(), tb.nbytes()) << name;
    EXPECT_EQ(0, std::memcmp(ta.raw_data(), tb.raw_data(), ta.nbytes())) << name;
  }
}

int64_t checkpoint_step(const std::filesystem::path& checkpoint) {
  return std::stoll(train::load_safetensors(checkpoint.string()).metadata().at("step"));
}

std::vector<std::string> run_devices() { return {"cpu", "cuda:0"}; }

}  // namespace octet::testing
