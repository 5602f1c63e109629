#include "octet/train/data.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>

#include "octet/core/hash.h"

namespace octet::train {
namespace {

// Shard tokens are used in place from the mapping, so the host must share the file's byte order.
static_assert(std::endian::native == std::endian::little, "llm.c shards are little-endian");

// llm.c's shard format (dev/data/data_common.py, write_datafile): a header of 256 int32s holding
// magic, version and token count, then the tokens as uint16.
constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int64_t kShardHeaderBytes = 256 * sizeof(int32_t);

bool starts_with_shard_magic(std::string_view bytes) {
  int32_t magic = 0;
  if (bytes.size() < sizeof(magic)) return false;
  std::memcpy(&magic, bytes.data(), sizeof(magic));
  return magic == kShardMagic;
}

// ----------------------------------------------------------------------------
// Random numbers: our own generators, so the batch order and the builtin corpus are the same
// with every standard library (std:: distributions are implementation-defined).

// splitmix64 (Steele, Lea and Flood, 2014; its finalizer is mix64, core/hash.h).
constexpr uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ULL;

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next() {
    state_ += kGoldenGamma;
    return mix64(state_);
  }
  /// Uniform in [0, n) by multiply-shift (Lemire); the bias (< n / 2^64) does not matter here.
  uint64_t below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }

 private:
  uint64_t state_;
};

/// A keyed bijection of [0, n): a balanced Feistel network on the smallest even-width power of
/// two holding n, with cycle walking back into range (at most 4x the domain, so few steps).
/// It orders an epoch's windows without storing a permutation.
class WindowOrder {
 public:
  WindowOrder(uint64_t n, uint64_t key)
      : n_(n),
        key_(key),
        half_bits_(std::max(1, static_cast<int>(std::bit_width(n - 1) + 1) / 2)) {}
  uint64_t operator()(uint64_t index) const {
    uint64_t x = index;
    do {
      x = encrypt(x);
    } while (x >= n_);
    return x;
  }

 private:
  // Rounds of the Feistel network; six mix well for any key (Luby-Rackoff needs four).
  static constexpr int kRounds = 6;
  uint64_t encrypt(uint64_t x) const {
    const uint64_t mask = (uint64_t{1} << half_bits_) - 1;
    uint64_t left = x >> half_bits_, right = x & mask;
    for (int round = 0; round < kRounds; ++round) {
      const uint64_t mixed = left ^ (mix64(right ^ (key_ + round * kGoldenGamma)) & mask);
      left = right;
      right = mixed;
    }
    return (left << half_bits_) | right;
  }
  uint64_t n_, key_;
  int half_bits_;
};

/// How one epoch cuts the train split: windows of seq+1 tokens starting at phase + k*seq,
/// visited in WindowOrder(windows, key). Drawn in this order from the epoch's RNG state.
struct EpochLayout {
  int64_t phase = 0;
  int64_t windows = 0;
  uint64_t key = 0;
  uint64_t next_state = 0;  ///< the following epoch's RNG state
};

EpochLayout epoch_layout(uint64_t rng_state, int seq, int64_t tokens) {
  // A window needs seq+1 tokens; the phase stays below seq (every cut is reachable) and leaves
  // room for at least one window.
  SplitMix64 rng(rng_state);
  EpochLayout layout;
  const int64_t max_phase = std::min<int64_t>(seq - 1, tokens - 1 - seq);
  layout.phase = static_cast<int64_t>(rng.below(static_cast<uint64_t>(max_phase) + 1));
  layout.windows = (tokens - 1 - layout.phase) / seq;
  layout.key = rng.next();
  layout.next_state = rng.next();
  return layout;
}

// ----------------------------------------------------------------------------
// Token storage shared by all sources: a split is a concatenation of segments, each a run of
// tokens kept alive by its owner (a vector or a file mapping).

struct Segment {
  std::shared_ptr<const void> owner;
  const uint16_t* tokens = nullptr;
  int64_t count = 0;
};

class TokenSpan {
 public:
  void append(Segment segment) {
    if (segment.count == 0) return;
    starts_.push_back(total_);
    total_ += segment.count;
    segments_.push_back(std::move(segment));
  }
  int64_t size() const { return total_; }

  /// Tokens [begin, end) of this span, sharing storage.
  TokenSpan slice(int64_t begin, int64_t end) const {
    TokenSpan out;
    for (size_t i = 0; i < segments_.size(); ++i) {
      const int64_t lo = std::max(begin, starts_[i]);
      const int64_t hi = std::min(end, starts_[i] + segments_[i].count);
      if (lo >= hi) continue;
      out.append({segments_[i].owner, segments_[i].tokens + (lo - starts_[i]), hi - lo});
    }
    return out;
  }

  void read(int64_t begin, int64_t count, uint16_t* out) const {
    OCTET_CHECK(begin >= 0 && count >= 0 && begin + count <= total_, "token range [", begin, ", ",
                begin + count, ") is outside a split of ", total_, " tokens");
    size_t i = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin();
    for (i = i == 0 ? 0 : i - 1; count > 0; ++i) {
      const int64_t offset = begin - starts_[i];
      const int64_t take = std::min(count, segments_[i].count - offset);
      std::memcpy(out, segments_[i].tokens + offset, static_cast<size_t>(take) * sizeof(uint16_t));
      out += take;
      begin += take;
      count -= take;
    }
  }

 private:
  std::vector<Segment> segments_;
  std::vector<int64_t> starts_;  ///< first token index of each segment
  int64_t total_ = 0;
};

/// Splits by position: the first 90% train, the last 10% val.
std::pair<TokenSpan, TokenSpan> split_by_position(const TokenSpan& all) {
  const int64_t val = all.size() / kValDenominator;
  const int64_t train = all.size() - val;
  return {all.slice(0, train), all.slice(train, all.size())};
}

class SpanSource final : public TokenSource {
 public:
  SpanSource(uint64_t seed, std::string description, int vocab, TokenSpan train, TokenSpan val)
      : TokenSource(seed),
        description_(std::move(description)),
        vocab_(vocab),
        train_(std::move(train)),
        val_(std::move(val)) {}
  int vocab_size() const override { return vocab_; }
  int64_t size(Split split) const override { return span(split).size(); }
  void read(Split split, int64_t begin, int64_t count, uint16_t* out) const override {
    span(split).read(begin, count, out);
  }
  std::string describe() const override { return description_; }

 private:
  const TokenSpan& span(Split split) const { return split == Split::train ? train_ : val_; }
  std::string description_;
  int vocab_;
  TokenSpan train_, val_;
};

/// A segment owning byte tokens (one token per byte).
Segment byte_segment(std::string_view bytes) {
  auto tokens = std::make_shared<std::vector<uint16_t>>(bytes.begin(), bytes.end());
  for (uint16_t& t : *tokens) t = static_cast<uint8_t>(t);  // chars may be signed
  return {tokens, tokens->data(), static_cast<int64_t>(tokens->size())};
}

std::unique_ptr<TokenSource> byte_source(uint64_t seed, std::string description,
                                         std::string_view bytes) {
  TokenSpan all;
  all.append(byte_segment(bytes));
  auto [train, val] = split_by_position(all);
  return std::make_unique<SpanSource>(seed, std::move(description), kByteVocab, std::move(train),
                                      std::move(val));
}

// ----------------------------------------------------------------------------
// Files

std::string read_file_bytes(const std::string& path, const char* what) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"),
                                                       &std::fclose);
  if (!file) OCTET_ERROR("cannot open ", what, " '", path, "': ", std::strerror(errno));
  std::string bytes;
  std::array<char, 1 << 16> buffer;
  size_t got;
  while ((got = std::fread(buffer.data(), 1, buffer.size(), file.get())) > 0)
    bytes.append(buffer.data(), got);
  if (std::ferror(file.get()))
    OCTET_ERROR("reading ", what, " '", path, "' failed: ", std::strerror(errno));
  return bytes;
}

struct FileDescriptor {
  int fd = -1;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

struct Mapping {
  void* address = MAP_FAILED;
  size_t bytes = 0;
  ~Mapping() {
    if (address != MAP_FAILED) ::munmap(address, bytes);
  }
};

/// Validates an llm.c shard's header and size, then maps its tokens.
Segment map_shard(const std::string& path) {
  FileDescriptor file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (file.fd < 0) OCTET_ERROR("cannot open bin shard '", path, "': ", std::strerror(errno));
  struct stat info {};
  OCTET_CHECK(::fstat(file.fd, &info) == 0, "cannot stat bin shard '", path,
              "': ", std::strerror(errno));
  if (!S_ISREG(info.st_mode)) OCTET_ERROR("bin shard '", path, "' is not a regular file");
  const int64_t file_bytes = info.st_size;
  if (file_bytes < kShardHeaderBytes)
    OCTET_ERROR("bin shard '", path, "': expected at least the ", kShardHeaderBytes,
                "-byte header, got ", file_bytes, " bytes");

  std::array<int32_t, 3> header{};  // magic, version, token count
  if (::pread(file.fd, header.data(), sizeof(header), 0) != static_cast<ssize_t>(sizeof(header)))
    OCTET_ERROR("reading the header of bin shard '", path, "' failed: ", std::strerror(errno));
  const auto [magic, version, count] = header;
  if (magic != kShardMagic)
    OCTET_ERROR("bin shard '", path, "': expected magic ", kShardMagic, ", got ", magic);
  if (version != kShardVersion)
    OCTET_ERROR("bin shard '", path, "': expected version ", kShardVersion, ", got ", version,
                " (version 1 holds uint16 tokens)");
  if (count < 0)
    OCTET_ERROR("bin shard '", path, "': expected a non-negative token count, got ", count);
  const int64_t expected = kShardHeaderBytes + int64_t{count} * int64_t{sizeof(uint16_t)};
  if (file_bytes != expected)
    OCTET_ERROR("bin shard '", path, "': expected ", expected, " bytes for ", count,
                " tokens, got ", file_bytes);

  auto mapping = std::make_shared<Mapping>();
  mapping->bytes = static_cast<size_t>(file_bytes);
  mapping->address = ::mmap(nullptr, mapping->bytes, PROT_READ, MAP_PRIVATE, file.fd, 0);
  if (mapping->address == MAP_FAILED)
    OCTET_ERROR("cannot map bin shard '", path, "': ", std::strerror(errno));
  const auto* tokens = reinterpret_cast<const uint16_t*>(
      static_cast<const char*>(mapping->address) + kShardHeaderBytes);
  return {mapping, tokens, count};
}

/// Files matching `pattern` (glob(3)), sorted bytewise so the order does not follow the locale.
std::vector<std::string> glob_files(const std::string& pattern) {
  glob_t matches{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &matches);
  std::vector<std::string> paths(matches.gl_pathv, matches.gl_pathv + matches.gl_pathc);
  ::globfree(&matches);
  if (rc == GLOB_NOMATCH || (rc == 0 && paths.empty()))
    OCTET_ERROR("bin:", pattern, " matched no files");
  if (rc != 0) OCTET_ERROR("bin:", pattern, ": glob failed (code ", rc, ")");
  std::sort(paths.begin(), paths.end());
  return paths;
}

/// The largest token id of a segment (0 when it is empty). One pass over the mapping, which
/// also pages the shard in: memory-bound, a fraction of a second for llm.c's 100M-token shards.
uint16_t max_token(const Segment& segment) {
  uint16_t largest = 0;
#pragma omp parallel for reduction(max : largest)
  for (int64_t i = 0; i < segment.count; ++i) largest = std::max(largest, segment.tokens[i]);
  return largest;
}

std::unique_ptr<TokenSource> bin_source(const std::string& pattern, uint64_t seed) {
  TokenSpan train, val;
  int largest = 0, train_shards = 0;
  for (const std::string& path : glob_files(pattern)) {
    // Only the file name decides: a folder called "eval" must not turn every shard into val.
    const bool is_val =
        std::filesystem::path(path).filename().string().find("val") != std::string::npos;
    Segment shard = map_shard(path);
    largest = std::max<int>(largest, max_token(shard));
    train_shards += !is_val;
    (is_val ? val : train).append(std::move(shard));
  }
  if (train.size() == 0 && val.size() == 0)
    OCTET_ERROR("bin:", pattern, ": the matched shards hold no tokens");
  if (train.size() == 0)
    OCTET_ERROR("bin:", pattern, ": ",
                train_shards == 0 ? "every matched shard has 'val' in its name"
                                  : "the shards without 'val' in their names hold no tokens",
                "; no train tokens");
  if (val.size() == 0) std::tie(train, val) = split_by_position(train);
  // The vocabulary is what the shards use (GPT-2's tokenizer: 50257), not all of uint16, so
  // GPT-2 shards fit the GPT-2 presets' padded vocabulary of 50304.
  return std::make_unique<SpanSource>(seed, "bin:" + pattern, largest + 1, std::move(train),
                                      std::move(val));
}

// ----------------------------------------------------------------------------
// The builtin corpus

// Operands are 0..99: one or two digits.
constexpr int kOperandLimit = 100;
constexpr std::array<char, 3> kOperators{'+', '-', '*'};
// One line in five is an English sentence; the rest is arithmetic.
constexpr int kSentenceOneIn = 5;

constexpr std::array<std::string_view, 8> kNames{"Alice", "Bob",   "Carol", "Dave",
                                                 "Erin",  "Frank", "Grace", "Heidi"};
// Nouns whose plural adds "s".
constexpr std::array<std::string_view, 8> kNouns{"apple", "book", "cat", "dog",
                                                 "cup",   "key",  "hat", "pen"};
constexpr std::array<std::string_view, 6> kAdjectives{"red", "small", "big",
                                                      "old", "green", "quiet"};
constexpr std::array<std::string_view, 5> kPlaces{"table", "floor", "shelf", "roof", "chair"};

template <typename Array>
std::string pick(SplitMix64& rng, const Array& words) {
  return std::string(words[rng.below(words.size())]);
}

ArithmeticProblem draw_problem(SplitMix64& rng) {
  const int a = static_cast<int>(rng.below(kOperandLimit));
  const int b = static_cast<int>(rng.below(kOperandLimit));
  const char op = kOperators[rng.below(kOperators.size())];
  const int result = op == '+' ? a + b : op == '-' ? a - b : a * b;
  return {std::to_string(a) + op + std::to_string(b) + "=", std::to_string(result)};
}

std::string draw_sentence(SplitMix64& rng) {
  // Small counts (2..9) keep the plural right and the sums short.
  auto count = [&rng] { return std::to_string(2 + rng.below(8)); };
  switch (rng.below(5)) {
    case 0:
      return pick(rng, kNames) + " has " + count() + " " + pick(rng, kNouns) + "s.";
    case 1: {
      // The receiver is drawn from the other names, so no one gives to themselves.
      const size_t giver = rng.below(kNames.size());
      const size_t receiver = (giver + 1 + rng.below(kNames.size() - 1)) % kNames.size();
      std::string n = count(), noun = pick(rng, kNouns);
      return std::string(kNames[giver]) + " gave " + n + " " + noun + "s to " +
             std::string(kNames[receiver]) + ".";
    }
    case 2: {
      std::string adjective = pick(rng, kAdjectives), noun = pick(rng, kNouns);
      return "The " + adjective + " " + noun + " is on the " + pick(rng, kPlaces) + ".";
    }
    case 3: {
      std::string name = pick(rng, kNames), adjective = pick(rng, kAdjectives);
      return name + " likes the " + adjective + " " + pick(rng, kNouns) + ".";
    }
    default: {
      const int a = 2 + static_cast<int>(rng.below(8)), b = 2 + static_cast<int>(rng.below(8));
      return std::to_string(a) + " plus " + std::to_string(b) + " is " + std::to_string(a + b) +
             ".";
    }
  }
}

}  // namespace

// ----------------------------------------------------------------------------
// DataPosition

std::string to_string(const DataPosition& position) {
  nlohmann::ordered_json j;
  j["epoch"] = position.epoch;
  j["cursor"] = position.cursor;
  j["rng_state"] = position.rng_state;
  return j.dump();
}

DataPosition parse_data_position(const std::string& text) {
  const auto fail = [&text]() -> DataPosition {
    OCTET_ERROR(
        "expected a data position {\"epoch\":E,\"cursor\":C,\"rng_state\":R} with "
        "non-negative integers, got '",
        text, "'");
  };
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.size() != 3) return fail();
  for (const char* key : {"epoch", "cursor", "rng_state"})
    if (!j.contains(key) || !j[key].is_number_unsigned()) return fail();
  DataPosition position{j["epoch"].get<int64_t>(), j["cursor"].get<int64_t>(),
                        j["rng_state"].get<uint64_t>()};
  if (position.epoch < 0 || position.cursor < 0) return fail();  // above INT64_MAX
  return position;
}

// ----------------------------------------------------------------------------
// TokenSource: the batch order

TokenSource::TokenSource(uint64_t seed) { position_.rng_state = mix64(seed); }

void TokenSource::set_position(const DataPosition& position) {
  OCTET_CHECK(position.epoch >= 0 && position.cursor >= 0,
              "expected a non-negative epoch and cursor, got ", to_string(position));
  position_ = position;
}

void TokenSource::check_batch_shape(Split split, int batch, int seq) const {
  OCTET_CHECK(batch >= 1 && seq >= 1, "expected batch >= 1 and seq >= 1, got batch ", batch,
              ", seq ", seq);
  const int64_t tokens = size(split);
  if (tokens < int64_t{seq} + 1)
    OCTET_ERROR("sequence longer than the data: seq ", seq, " needs ", int64_t{seq} + 1,
                " tokens, the ", split == Split::train ? "train" : "val", " split of ", describe(),
                " has ", tokens);
}

namespace {
Batch empty_batch(int batch, int seq) {
  return {Tensor::empty({batch, seq}, DType::i32), Tensor::empty({batch, seq}, DType::i32)};
}

/// Row `row` of the batch from a window of seq+1 tokens.
void store_window(const Batch& out, int row, const std::vector<uint16_t>& window) {
  const size_t seq = window.size() - 1;
  int32_t* inputs = out.inputs.data<int32_t>() + row * seq;
  int32_t* targets = out.targets.data<int32_t>() + row * seq;
  for (size_t t = 0; t < seq; ++t) {
    inputs[t] = window[t];
    targets[t] = window[t + 1];
  }
}
}  // namespace

Batch TokenSource::next_batch(int batch, int seq) {
  check_batch_shape(Split::train, batch, seq);
  const int64_t tokens = size(Split::train);
  Batch out = empty_batch(batch, seq);
  std::vector<uint16_t> window(seq + 1);
  DataPosition position = position_;  // committed only when the whole batch was read
  for (int row = 0; row < batch; ++row) {
    EpochLayout layout = epoch_layout(position.rng_state, seq, tokens);
    while (position.cursor >= layout.windows) {
      position = {position.epoch + 1, 0, layout.next_state};
      layout = epoch_layout(position.rng_state, seq, tokens);
    }
    const uint64_t index = WindowOrder(layout.windows, layout.key)(position.cursor++);
    read(Split::train, layout.phase + static_cast<int64_t>(index) * seq, seq + 1, window.data());
    store_window(out, row, window);
  }
  position_ = position;
  return out;
}

int64_t TokenSource::val_batch_count(int batch, int seq) const {
  check_batch_shape(Split::val, batch, seq);
  const int64_t windows = (size(Split::val) - 1) / seq;
  return std::max<int64_t>(1, windows / batch);
}

Batch TokenSource::val_batch(int64_t index, int batch, int seq) const {
  OCTET_CHECK(index >= 0, "expected a non-negative val batch index, got ", index);
  const int64_t first = (index % val_batch_count(batch, seq)) * batch;  // checks the shape
  const int64_t windows = (size(Split::val) - 1) / seq;
  Batch out = empty_batch(batch, seq);
  std::vector<uint16_t> window(seq + 1);
  for (int row = 0; row < batch; ++row) {
    read(Split::val, ((first + row) % windows) * seq, seq + 1, window.data());
    store_window(out, row, window);
  }
  return out;
}

// ----------------------------------------------------------------------------
// Sources

std::unique_ptr<TokenSource> make_token_source(const std::string& spec, uint64_t seed) {
  constexpr std::string_view kText = "text:", kBin = "bin:";
  if (spec == "builtin") return byte_source(seed, "builtin", builtin_corpus_text());
  if (spec.starts_with(kText)) {
    const std::string path = spec.substr(kText.size());
    OCTET_CHECK(!path.empty(), "expected text:PATH, got '", spec, "'");
    const std::string bytes = read_file_bytes(path, "text file");
    if (bytes.empty()) OCTET_ERROR("text file '", path, "' is empty");
    // Text holds no NUL bytes; a file that does is binary (an llm.c shard, a checkpoint, ...)
    // and would train on its bytes without complaint.
    if (const size_t nul = bytes.find('\0'); nul != std::string::npos)
      OCTET_ERROR("text file '", path, "' looks binary (a NUL byte at offset ", nul,
                  "); expected text",
                  starts_with_shard_magic(bytes) ? " (it is an llm.c shard: use bin:PATH)" : "");
    return byte_source(seed, spec, bytes);
  }
  if (spec.starts_with(kBin)) {
    const std::string pattern = spec.substr(kBin.size());
    OCTET_CHECK(!pattern.empty(), "expected bin:GLOB, got '", spec, "'");
    return bin_source(pattern, seed);
  }
  OCTET_ERROR("unknown data source '", spec, "'; expected builtin, text:PATH or bin:GLOB");
}

std::string builtin_corpus_text() {
  SplitMix64 rng(kBuiltinCorpusSeed);
  std::string text;
  text.reserve(kBuiltinCorpusBytes + 64);
  while (static_cast<int64_t>(text.size()) < kBuiltinCorpusBytes) {
    if (rng.below(kSentenceOneIn) == 0) {
      text += draw_sentence(rng);
    } else {
      ArithmeticProblem p = draw_problem(rng);
      text += p.prompt + p.answer;
    }
    text += '\n';
  }
  text.resize(kBuiltinCorpusBytes);
  return text;
}

std::vector<ArithmeticProblem> arithmetic_problems(int count, uint64_t seed) {
  OCTET_CHECK(count >= 0, "expected a non-negative problem count, got ", count);
  SplitMix64 rng(seed);
  std::vector<ArithmeticProblem> problems;
  problems.reserve(count);
  for (int i = 0; i < count; ++i) problems.push_back(draw_problem(rng));
  return problems;
}

double evaluate_arithmetic(const GenerateFn& generate, int count, uint64_t seed) {
  OCTET_CHECK(generate != nullptr, "evaluate_arithmetic needs a generate callback");
  OCTET_CHECK(count >= 1, "expected at least 1 arithmetic problem, got ", count);
  int correct = 0;
  for (const ArithmeticProblem& p : arithmetic_problems(count, seed)) {
    const std::string text = generate(p.prompt, kArithmeticMaxNewTokens);
    correct += text.substr(0, text.find('\n')) == p.answer;
  }
  return static_cast<double>(correct) / count;
}

}  // namespace octet::train
