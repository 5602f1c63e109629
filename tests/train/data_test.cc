#include "octet/train/data.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>

#include "octet/train/trainer.h"
#include "test_util.h"
#include "train/scratch_dir.h"

namespace octet::train {
namespace {

using octet::testing::bitwise_equal;
using octet::testing::error_of;
using octet::testing::fresh_seed;
using octet::testing::scratch_dir;
using ::testing::HasSubstr;

// ----------------------------------------------------------------------------
// Helpers

/// Token i of the train split is i (mod 2^16), of the val split 60000 + i: every window of a
/// small split names its own start, so tests can see exactly which windows were read.
class CountingSource final : public TokenSource {
 public:
  static constexpr uint16_t kValBase = 60000;
  CountingSource(uint64_t seed, int64_t train, int64_t val)
      : TokenSource(seed), train_(train), val_(val) {}
  int vocab_size() const override { return kMaxVocab; }
  int64_t size(Split split) const override { return split == Split::train ? train_ : val_; }
  void read(Split split, int64_t begin, int64_t count, uint16_t* out) const override {
    for (int64_t i = 0; i < count; ++i)
      out[i] = static_cast<uint16_t>((split == Split::val ? kValBase : 0) + begin + i);
  }
  std::string describe() const override { return "counting"; }

 private:
  int64_t train_, val_;
};

std::vector<int32_t> values(const Tensor& t) {
  return std::vector<int32_t>(t.data<int32_t>(), t.data<int32_t>() + t.numel());
}

/// Checks shapes, dtypes and that targets are inputs shifted by one within each row.
void expect_well_formed(const Batch& b, int batch, int seq) {
  ASSERT_EQ(b.inputs.shape(), (Shape{batch, seq}));
  ASSERT_EQ(b.targets.shape(), (Shape{batch, seq}));
  ASSERT_EQ(b.inputs.dtype(), DType::i32);
  ASSERT_EQ(b.targets.dtype(), DType::i32);
  ASSERT_TRUE(b.inputs.device().is_cpu());
  const int32_t* in = b.inputs.data<int32_t>();
  const int32_t* tg = b.targets.data<int32_t>();
  for (int r = 0; r < batch; ++r)
    for (int t = 0; t + 1 < seq; ++t) ASSERT_EQ(in[r * seq + t + 1], tg[r * seq + t]);
}

::testing::AssertionResult same_batch(const Batch& a, const Batch& b) {
  if (auto r = bitwise_equal(a.inputs, b.inputs); !r) return r << " (inputs)";
  if (auto r = bitwise_equal(a.targets, b.targets); !r) return r << " (targets)";
  return ::testing::AssertionSuccess();
}

void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

/// An llm.c shard; the header fields can be overridden to make bad shards.
struct ShardSpec {
  std::vector<uint16_t> tokens;
  int32_t magic = 20240520;
  int32_t version = 1;
  std::optional<int32_t> count;  ///< header token count (default: tokens.size())
  int extra_bytes = 0;           ///< appended after the tokens (negative: cut off the end)
};

void write_shard(const std::filesystem::path& path, const ShardSpec& spec) {
  std::array<int32_t, 256> header{};
  header[0] = spec.magic;
  header[1] = spec.version;
  header[2] = spec.count.value_or(static_cast<int32_t>(spec.tokens.size()));
  std::string bytes(reinterpret_cast<const char*>(header.data()), sizeof(header));
  bytes.append(reinterpret_cast<const char*>(spec.tokens.data()), spec.tokens.size() * 2);
  if (spec.extra_bytes >= 0) {
    bytes.append(spec.extra_bytes, '\x7f');
  } else {
    bytes.resize(bytes.size() + spec.extra_bytes);
  }
  write_bytes(path, bytes);
}

std::vector<uint16_t> random_tokens(size_t n, std::mt19937_64& rng) {
  std::vector<uint16_t> tokens(n);
  for (uint16_t& t : tokens) t = static_cast<uint16_t>(rng());
  return tokens;
}

std::vector<uint16_t> read_all(const TokenSource& source, Split split) {
  std::vector<uint16_t> out(source.size(split));
  source.read(split, 0, source.size(split), out.data());
  return out;
}

// ----------------------------------------------------------------------------
// Batch order

TEST(TokenSourceOrder, EveryEpochVisitsEachWindowOnceInShuffledOrder) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  constexpr int kSeq = 7, kEpochs = 8;
  CountingSource source(seed, /*train=*/3001, /*val=*/100);
  std::map<int64_t, std::vector<int64_t>> starts_by_epoch;
  while (source.position().epoch < kEpochs) {
    // One row per batch, so each row's epoch is the position's epoch after it.
    Batch b = source.next_batch(1, kSeq);
    expect_well_formed(b, 1, kSeq);
    const DataPosition after = source.position();
    starts_by_epoch[after.epoch].push_back(b.inputs.data<int32_t>()[0]);
    EXPECT_EQ(b.targets.data<int32_t>()[kSeq - 1], b.inputs.data<int32_t>()[0] + kSeq);
  }
  std::set<int64_t> phases;
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    std::vector<int64_t> starts = starts_by_epoch[epoch];
    ASSERT_FALSE(starts.empty());
    const int64_t phase = *std::min_element(starts.begin(), starts.end());
    phases.insert(phase);
    ASSERT_LT(phase, kSeq);
    const int64_t windows = (3001 - 1 - phase) / kSeq;
    ASSERT_EQ(static_cast<int64_t>(starts.size()), windows) << "epoch " << epoch;
    EXPECT_FALSE(std::is_sorted(starts.begin(), starts.end())) << "epoch " << epoch;
    std::sort(starts.begin(), starts.end());
    for (int64_t k = 0; k < windows; ++k) ASSERT_EQ(starts[k], phase + k * kSeq);
  }
  // Eight independent phases in [0, 7) are all equal with probability 7^-7.
  EXPECT_GT(phases.size(), 1u);
  EXPECT_NE(starts_by_epoch[0], starts_by_epoch[1]);
}

TEST(TokenSourceOrder, BuiltinSameSeedSameBatchesDifferentSeedDiffers) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  auto a = make_token_source("builtin", seed);
  auto b = make_token_source("builtin", seed);
  auto c = make_token_source("builtin", seed + 1);
  EXPECT_EQ(a->vocab_size(), kByteVocab);
  bool any_differs = false;
  for (int i = 0; i < 5; ++i) {
    Batch x = a->next_batch(4, 64), y = b->next_batch(4, 64), z = c->next_batch(4, 64);
    expect_well_formed(x, 4, 64);
    EXPECT_TRUE(same_batch(x, y)) << "batch " << i;
    any_differs |= values(x.inputs) != values(z.inputs);
  }
  EXPECT_TRUE(any_differs);
  EXPECT_EQ(a->position(), b->position());
}

TEST(TokenSourceOrder, RestoredPositionReadsIdenticalBatchesAcrossEpochs) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  // A small split so the replay crosses several epoch boundaries.
  CountingSource run(seed, /*train=*/200, /*val=*/50);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < static_cast<int>(rng() % 13); ++i) run.next_batch(3, 9);
  const DataPosition saved = run.position();
  const std::string saved_text = to_string(saved);
  std::vector<Batch> expected;
  for (int i = 0; i < 40; ++i) expected.push_back(run.next_batch(3, 9));
  EXPECT_GT(run.position().epoch, saved.epoch + 2);

  CountingSource resumed(seed + 12345, 200, 50);  // the position alone decides the batches
  resumed.set_position(parse_data_position(saved_text));
  EXPECT_EQ(resumed.position(), saved);
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(same_batch(expected[i], resumed.next_batch(3, 9)));
  EXPECT_EQ(resumed.position(), run.position());
}

TEST(TokenSourceOrder, BuiltinResumeIsBitwise) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  auto run = make_token_source("builtin", seed);
  for (int i = 0; i < 3; ++i) run->next_batch(2, 128);
  const DataPosition saved = run->position();
  const Batch expected = run->next_batch(2, 128);
  auto resumed = make_token_source("builtin", seed);
  resumed->set_position(saved);
  EXPECT_TRUE(same_batch(expected, resumed->next_batch(2, 128)));
}

TEST(DataPosition, TextRoundTripAndErrors) {
  const DataPosition p{3, 17, 0xfedcba9876543210ULL};
  EXPECT_EQ(parse_data_position(to_string(p)), p);
  for (const std::string bad : {"", "{}", "[1,2,3]", "{\"epoch\":1,\"cursor\":2}",
                                "{\"epoch\":-1,\"cursor\":0,\"rng_state\":1}",
                                "{\"epoch\":1.5,\"cursor\":0,\"rng_state\":1}",
                                "{\"epoch\":1,\"cursor\":0,\"rng_state\":\"x\"}"}) {
    EXPECT_THAT(error_of([&] { parse_data_position(bad); }), HasSubstr("expected a data position"))
        << bad;
  }
  CountingSource source(1, 100, 10);
  EXPECT_THAT(error_of([&] {
                source.set_position({-1, 0, 0});
              }),
              HasSubstr("expected a non-negative epoch and cursor"));
}

TEST(TokenSourceVal, IndependentOfTrainingPositionAndSeed) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  CountingSource a(seed, 500, 103), b(seed ^ 0x5555, 500, 103);
  const int64_t count = a.val_batch_count(2, 10);
  EXPECT_EQ(count, (103 - 1) / 10 / 2);
  std::vector<Batch> before;
  for (int64_t i = 0; i < count; ++i) before.push_back(a.val_batch(i, 2, 10));
  for (int i = 0; i < 7; ++i) a.next_batch(4, 10);
  for (int64_t i = 0; i < count; ++i) {
    const Batch after = a.val_batch(i, 2, 10);
    expect_well_formed(after, 2, 10);
    EXPECT_TRUE(same_batch(before[i], after));
    EXPECT_TRUE(same_batch(before[i], b.val_batch(i, 2, 10)));
    // Unshuffled windows from the start of the val split.
    EXPECT_EQ(after.inputs.data<int32_t>()[0], CountingSource::kValBase + i * 20);
    EXPECT_EQ(after.inputs.data<int32_t>()[10], CountingSource::kValBase + i * 20 + 10);
  }
  EXPECT_TRUE(same_batch(a.val_batch(count, 2, 10), before[0]));  // wraps around
  // Fewer val windows than the batch: one batch that repeats windows.
  EXPECT_EQ(a.val_batch_count(64, 10), 1);
  const Batch big = a.val_batch(0, 64, 10);
  EXPECT_EQ(big.inputs.data<int32_t>()[10 * 10], CountingSource::kValBase);
}

TEST(TokenSourceVal, BuiltinValComesFromTheLastTenthOfTheCorpus) {
  auto source = make_token_source("builtin", 7);
  const std::string corpus = builtin_corpus_text();
  const int64_t val = kBuiltinCorpusBytes / kValDenominator;
  ASSERT_EQ(source->size(Split::val), val);
  ASSERT_EQ(source->size(Split::train), kBuiltinCorpusBytes - val);
  const Batch b = source->val_batch(3, 2, 32);
  const int32_t* in = b.inputs.data<int32_t>();
  for (int t = 0; t < 32; ++t)
    ASSERT_EQ(in[t], static_cast<uint8_t>(corpus[kBuiltinCorpusBytes - val + 3 * 2 * 32 + t]));
}

// ----------------------------------------------------------------------------
// Builtin corpus and arithmetic evaluation

std::string solve(const std::string& prompt) {
  static const std::regex kProblem(R"((\d{1,2})([-+*])(\d{1,2})=)");
  std::smatch m;
  EXPECT_TRUE(std::regex_match(prompt, m, kProblem)) << prompt;
  const int a = std::stoi(m[1]), b = std::stoi(m[3]);
  const char op = m[2].str()[0];
  return std::to_string(op == '+' ? a + b : op == '-' ? a - b : a * b);
}

TEST(BuiltinCorpus, ArithmeticIsCorrectAndSentencesAreMixedIn) {
  const std::string corpus = builtin_corpus_text();
  ASSERT_EQ(static_cast<int64_t>(corpus.size()), kBuiltinCorpusBytes);
  EXPECT_EQ(corpus, builtin_corpus_text());
  static const std::regex kLine(R"((\d{1,2}[-+*]\d{1,2}=)(-?\d{1,4}))");
  static const std::regex kSentence(R"([A-Z0-9][A-Za-z0-9 ]*[a-z0-9]\.)");
  int64_t arithmetic = 0, sentences = 0;
  std::set<char> operators;
  size_t begin = 0;
  for (size_t end; (end = corpus.find('\n', begin)) != std::string::npos; begin = end + 1) {
    const std::string line = corpus.substr(begin, end - begin);
    std::smatch m;
    if (std::regex_match(line, m, kLine)) {
      ASSERT_EQ(m[2].str(), solve(m[1].str())) << line;
      operators.insert(line[line.find_first_of("+-*", 1)]);
      ++arithmetic;
    } else {
      ASSERT_TRUE(std::regex_match(line, kSentence)) << "unexpected line '" << line << "'";
      ++sentences;
    }
  }
  EXPECT_EQ(operators, (std::set<char>{'+', '-', '*'}));
  const double sentence_share = double(sentences) / double(arithmetic + sentences);
  EXPECT_NEAR(sentence_share, 0.2, 0.01);
}

TEST(ArithmeticEval, ProblemsAreDeterministicPerSeedAndCorrect) {
  const auto a = arithmetic_problems(300), b = arithmetic_problems(300);
  const auto c = arithmetic_problems(300, kArithmeticEvalSeed + 1);
  static_assert(kArithmeticEvalSeed != kBuiltinCorpusSeed);
  int same_as_c = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].prompt, b[i].prompt);
    EXPECT_EQ(a[i].answer, solve(a[i].prompt));
    EXPECT_LE(static_cast<int>(a[i].answer.size()) + 1, kArithmeticMaxNewTokens);
    same_as_c += a[i].prompt == c[i].prompt;
  }
  EXPECT_LT(same_as_c, 10);
}

TEST(ArithmeticEval, AccuracyCountsExactAnswersUpToNewline) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  int calls = 0;
  const auto oracle = [&](const std::string& prompt, int max_new) {
    ++calls;
    EXPECT_EQ(max_new, kArithmeticMaxNewTokens);
    return solve(prompt) + "\n12";  // text after the newline does not count
  };
  EXPECT_EQ(evaluate_arithmetic(oracle, 97, seed), 1.0);
  EXPECT_EQ(calls, 97);
  EXPECT_EQ(evaluate_arithmetic([](const std::string&, int) { return std::string("x"); }, 50, seed),
            0.0);
  // Right only on additions, and "answer + extra digit" is wrong.
  const auto problems = arithmetic_problems(200, seed);
  const int additions = static_cast<int>(std::count_if(
      problems.begin(), problems.end(),
      [](const ArithmeticProblem& p) { return p.prompt.find('+') != std::string::npos; }));
  const auto plus_only = [](const std::string& prompt, int) {
    return prompt.find('+') != std::string::npos ? solve(prompt) : solve(prompt) + "0";
  };
  EXPECT_DOUBLE_EQ(evaluate_arithmetic(plus_only, 200, seed), additions / 200.0);
  EXPECT_THAT(error_of([] { evaluate_arithmetic(nullptr, 5); }), HasSubstr("callback"));
  EXPECT_THAT(error_of([&] { evaluate_arithmetic(oracle, 0); }), HasSubstr("at least 1"));
}

// ----------------------------------------------------------------------------
// Text files

TEST(TextSource, ByteTokensSplitNinetyTen) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::string bytes(1000 + rng() % 3000, '\0');
  // Every byte but NUL (which marks a binary file); bytes >= 128 must stay positive.
  for (char& c : bytes) c = static_cast<char>(1 + rng() % 255);
  const auto path = scratch_dir() / "corpus.txt";
  write_bytes(path, bytes);
  auto source = make_token_source("text:" + path.string(), seed);
  EXPECT_EQ(source->vocab_size(), 256);
  EXPECT_EQ(source->describe(), "text:" + path.string());
  const int64_t n = bytes.size(), val = n / 10;
  ASSERT_EQ(source->size(Split::train), n - val);
  ASSERT_EQ(source->size(Split::val), val);
  std::vector<uint16_t> all = read_all(*source, Split::train), tail = read_all(*source, Split::val);
  all.insert(all.end(), tail.begin(), tail.end());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(all[i], static_cast<uint8_t>(bytes[i])) << i;

  // Every training row is a window of the train split.
  const std::string train_text = bytes.substr(0, n - val);
  const Batch b = source->next_batch(3, 16);
  expect_well_formed(b, 3, 16);
  for (int r = 0; r < 3; ++r) {
    std::string row;
    for (int t = 0; t < 16; ++t) row += static_cast<char>(b.inputs.data<int32_t>()[r * 16 + t]);
    row += static_cast<char>(b.targets.data<int32_t>()[r * 16 + 15]);
    EXPECT_NE(train_text.find(row), std::string::npos) << "row " << r;
  }
}

// ----------------------------------------------------------------------------
// llm.c shards

TEST(BinSource, ShardsConcatenateInSortedOrderWithValFiles) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const auto dir = scratch_dir();
  const auto t0 = random_tokens(1000 + rng() % 500, rng), t1 = random_tokens(777, rng);
  const auto v0 = random_tokens(300, rng);
  // Written out of order: the source sorts by name.
  write_shard(dir / "data_train_001.bin", {t1});
  write_shard(dir / "data_val_000.bin", {v0});
  write_shard(dir / "data_train_000.bin", {t0});
  write_bytes(dir / "notes.txt", "not a shard");
  auto source = make_token_source("bin:" + (dir / "data_*.bin").string(), seed);
  const uint16_t largest =
      std::max({*std::max_element(t0.begin(), t0.end()), *std::max_element(t1.begin(), t1.end()),
                *std::max_element(v0.begin(), v0.end())});
  EXPECT_EQ(source->vocab_size(), largest + 1) << "the largest token id of every shard, + 1";
  std::vector<uint16_t> expected = t0;
  expected.insert(expected.end(), t1.begin(), t1.end());
  EXPECT_EQ(read_all(*source, Split::train), expected);
  EXPECT_EQ(read_all(*source, Split::val), v0);
  // A window across the shard boundary.
  std::vector<uint16_t> across(10);
  source->read(Split::train, t0.size() - 4, 10, across.data());
  EXPECT_TRUE(std::equal(across.begin(), across.end(), expected.begin() + t0.size() - 4));
  const Batch b = source->next_batch(4, 33);
  expect_well_formed(b, 4, 33);
  for (int r = 0; r < 4; ++r) {
    std::vector<uint16_t> row(b.inputs.data<int32_t>() + r * 33,
                              b.inputs.data<int32_t>() + (r + 1) * 33);
    row.push_back(static_cast<uint16_t>(b.targets.data<int32_t>()[r * 33 + 32]));
    EXPECT_NE(std::search(expected.begin(), expected.end(), row.begin(), row.end()), expected.end())
        << "row " << r << " is not a window of the train shards";
  }
}

TEST(BinSource, WithoutValFilesTheLastTenthIsVal) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const auto dir = scratch_dir();
  const auto t0 = random_tokens(555, rng), t1 = random_tokens(451, rng);
  write_shard(dir / "a.bin", {t0});
  write_shard(dir / "b.bin", {t1});
  auto source = make_token_source("bin:" + (dir / "*.bin").string(), seed);
  // Only file names mark val shards: a folder whose name holds "val" does not.
  const auto folder = dir / "interval";
  std::filesystem::create_directories(folder);
  write_shard(folder / "a.bin", {t0});
  EXPECT_EQ(make_token_source("bin:" + (folder / "*.bin").string(), seed)->size(Split::val),
            static_cast<int64_t>(t0.size() / 10));
  std::vector<uint16_t> all = t0;
  all.insert(all.end(), t1.begin(), t1.end());
  const size_t val = all.size() / 10;
  EXPECT_EQ(read_all(*source, Split::train), std::vector<uint16_t>(all.begin(), all.end() - val));
  EXPECT_EQ(read_all(*source, Split::val), std::vector<uint16_t>(all.end() - val, all.end()));
}

/// GPT-2's tokenizer has 50257 tokens; its end-of-text token 50256 is the largest id.
constexpr uint16_t kGpt2EndOfText = 50256;

TEST(BinSource, VocabularyIsTheLargestTokenIdPlusOne) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const auto dir = scratch_dir();
  // Shards as llm.c's GPT-2 preprocessing writes them: ids below 50257, documents separated
  // by the end-of-text token, which only one shard holds here.
  std::vector<uint16_t> a(800), b(600);
  for (uint16_t& t : a) t = static_cast<uint16_t>(rng() % kGpt2EndOfText);
  for (uint16_t& t : b) t = static_cast<uint16_t>(rng() % kGpt2EndOfText);
  b[rng() % b.size()] = kGpt2EndOfText;
  write_shard(dir / "gpt2_train_000.bin", {a});
  write_shard(dir / "gpt2_train_001.bin", {b});
  auto source = make_token_source("bin:" + (dir / "gpt2_*.bin").string(), seed);
  EXPECT_EQ(source->vocab_size(), kGpt2EndOfText + 1);

  // The GPT-2 presets take such data as they are (their vocab, 50304, was too small for 65536).
  for (const char* preset : {"gpt2-124m", "gpt2-350m"}) {
    TrainOptions options;
    options.model = preset;
    const ModelConfig config = resolve_model_config(options, source->vocab_size());
    EXPECT_GE(config.vocab, kGpt2EndOfText + 1) << preset;
  }

  // The top id of uint16 makes the vocabulary all of it.
  write_shard(dir / "top.bin", {{0, 65535, 3}});
  EXPECT_EQ(make_token_source("bin:" + (dir / "top.bin").string(), seed)->vocab_size(), kMaxVocab);
}

// ----------------------------------------------------------------------------
// Bad input: each case names the problem.

struct BadSourceCase {
  const char* name;
  std::function<std::string(const std::filesystem::path& dir)> make;  ///< returns the spec
  std::vector<std::string> expected;                                  ///< message substrings
};

std::string shard_spec(const std::filesystem::path& dir, const ShardSpec& spec) {
  write_shard(dir / "shard.bin", spec);
  return "bin:" + (dir / "shard.bin").string();
}

const std::vector<uint16_t> kSomeTokens(64, 7);

class BadSource : public ::testing::TestWithParam<BadSourceCase> {};

TEST_P(BadSource, ThrowsAClearError) {
  const auto dir = scratch_dir();
  const std::string spec = GetParam().make(dir);
  const std::string message = error_of([&] { make_token_source(spec, 1); });
  for (const std::string& expected : GetParam().expected) EXPECT_THAT(message, HasSubstr(expected));
  EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
}

INSTANTIATE_TEST_SUITE_P(
    DataSpecs, BadSource,
    ::testing::Values(
        BadSourceCase{"UnknownSpec",
                      [](auto&) { return std::string("csv:foo"); },
                      {"unknown data source 'csv:foo'", "builtin, text:PATH or bin:GLOB"}},
        BadSourceCase{"MissingTextFile",
                      [](auto& dir) { return "text:" + (dir / "nope.txt").string(); },
                      {"cannot open text file", "nope.txt", "No such file"}},
        BadSourceCase{"EmptyTextFile",
                      [](auto& dir) {
                        write_bytes(dir / "empty.txt", "");
                        return "text:" + (dir / "empty.txt").string();
                      },
                      {"empty.txt' is empty"}},
        BadSourceCase{"BinaryTextFile",
                      [](auto& dir) {
                        write_bytes(dir / "model.pt", std::string("PK\x03\x04\0\0data", 10));
                        return "text:" + (dir / "model.pt").string();
                      },
                      {"model.pt' looks binary (a NUL byte at offset 4); expected text"}},
        BadSourceCase{"ShardAsText",
                      [](auto& dir) {
                        write_shard(dir / "train.bin", {kSomeTokens});
                        return "text:" + (dir / "train.bin").string();
                      },
                      {"train.bin' looks binary", "it is an llm.c shard: use bin:PATH"}},
        BadSourceCase{"ShardsWithoutTokens",
                      [](auto& dir) {
                        write_shard(dir / "a.bin", {});
                        write_shard(dir / "b_val.bin", {});
                        return "bin:" + (dir / "*.bin").string();
                      },
                      {"*.bin: the matched shards hold no tokens"}},
        BadSourceCase{"WrongMagic",
                      [](auto& dir) {
                        return shard_spec(dir, {kSomeTokens, 20240519});
                      },
                      {"shard.bin", "expected magic 20240520, got 20240519"}},
        BadSourceCase{"WrongVersion",
                      [](auto& dir) {
                        return shard_spec(dir, {kSomeTokens, 20240520, 2});
                      },
                      {"expected version 1, got 2"}},
        BadSourceCase{"TooManyBytes",
                      [](auto& dir) {
                        return shard_spec(dir, {kSomeTokens, 20240520, 1, std::nullopt, 2});
                      },
                      {"expected 1152 bytes for 64 tokens, got 1154"}},
        BadSourceCase{"TooFewBytes",
                      [](auto& dir) {
                        return shard_spec(dir, {kSomeTokens, 20240520, 1, std::nullopt, -1});
                      },
                      {"expected 1152 bytes for 64 tokens, got 1151"}},
        BadSourceCase{"CountDisagrees",
                      [](auto& dir) {
                        return shard_spec(dir, {kSomeTokens, 20240520, 1, 100});
                      },
                      {"expected 1224 bytes for 100 tokens, got 1152"}},
        BadSourceCase{"NegativeCount",
                      [](auto& dir) {
                        return shard_spec(dir, {kSomeTokens, 20240520, 1, -3});
                      },
                      {"expected a non-negative token count, got -3"}},
        BadSourceCase{"ShorterThanHeader",
                      [](auto& dir) {
                        write_bytes(dir / "short.bin", std::string(100, '\0'));
                        return "bin:" + (dir / "short.bin").string();
                      },
                      {"short.bin", "expected at least the 1024-byte header, got 100 bytes"}},
        BadSourceCase{"GlobMatchesNothing",
                      [](auto& dir) { return "bin:" + (dir / "*.bin").string(); },
                      {"*.bin matched no files"}},
        BadSourceCase{"OnlyValShards",
                      [](auto& dir) {
                        write_shard(dir / "x_val.bin", {kSomeTokens});
                        return "bin:" + (dir / "*.bin").string();
                      },
                      {"every matched shard has 'val' in its name"}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(BadSource, SequenceLongerThanTheData) {
  const auto dir = scratch_dir();
  write_bytes(dir / "small.txt", std::string(100, 'a'));  // 90 train, 10 val
  auto source = make_token_source("text:" + (dir / "small.txt").string(), 1);
  EXPECT_THAT(error_of([&] { source->next_batch(1, 90); }),
              HasSubstr("sequence longer than the data: seq 90 needs 91 tokens, the train split "
                        "of text:"));
  EXPECT_THAT(error_of([&] { source->val_batch(0, 1, 10); }),
              HasSubstr("seq 10 needs 11 tokens, the val split of text:"));
  EXPECT_NO_THROW(source->next_batch(2, 89));
  EXPECT_NO_THROW(source->val_batch(0, 2, 9));
  EXPECT_THAT(error_of([&] { source->next_batch(0, 4); }), HasSubstr("expected batch >= 1"));
}

}  // namespace
}  // namespace octet::train
