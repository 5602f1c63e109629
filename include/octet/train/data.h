// Token data for training: sources of uint16 token ids with a train/val split, and a seeded,
// resumable order of training batches.
//
// Training batches are windows of seq+1 consecutive train tokens. Each epoch cuts the train split
// into windows at a random phase and visits them in a random order (a keyed bijection, so no
// permutation is stored); both come from the epoch's RNG state. A DataPosition (epoch, cursor,
// RNG state) pins the reader exactly, so a resumed run reads the same batches bitwise. Val batches
// are a pure function of their index: unshuffled windows from the start of the val split.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "octet/core/tensor.h"

namespace octet::train {

/// Vocabulary of byte-level sources (text files and the builtin corpus).
inline constexpr int kByteVocab = 256;
/// Token ids are uint16, so no vocabulary is larger than this.
inline constexpr int kMaxVocab = 65536;
/// Sources without a dedicated val split hold out this fraction (1/10) of their tokens, taken
/// from the end (the first 90% train, the last 10% val).
inline constexpr int64_t kValDenominator = 10;

/// One batch: int32 CPU tensors of shape [batch, seq]; targets[b, t] = inputs[b, t + 1] in the
/// underlying token stream.
struct Batch {
  Tensor inputs;
  Tensor targets;
};

/// Where the training reader stands. Plain integers, so a checkpoint can store them.
struct DataPosition {
  int64_t epoch = 0;       ///< completed passes over the train split
  int64_t cursor = 0;      ///< windows already read in this epoch
  uint64_t rng_state = 0;  ///< this epoch's RNG state (decides its phase and window order)
  friend bool operator==(const DataPosition&, const DataPosition&) = default;
};

/// JSON text {"epoch":E,"cursor":C,"rng_state":R} (for checkpoint metadata).
std::string to_string(const DataPosition& position);
/// Inverse of to_string; throws octet::Error on anything else.
DataPosition parse_data_position(const std::string& text);

enum class Split { train, val };

/// A source of token ids with a train/val split. Subclasses provide the tokens; this class owns
/// the batch order.
class TokenSource {
 public:
  /// `seed` decides the order of training batches (not the tokens).
  explicit TokenSource(uint64_t seed);
  virtual ~TokenSource() = default;
  TokenSource(const TokenSource&) = delete;
  TokenSource& operator=(const TokenSource&) = delete;

  /// Token ids are < vocab_size() (<= kMaxVocab): 256 for byte-level sources, the largest id
  /// present + 1 for llm.c shards (50257 for GPT-2's tokenizer).
  virtual int vocab_size() const = 0;
  /// Number of tokens in `split`.
  virtual int64_t size(Split split) const = 0;
  /// Copies tokens [begin, begin + count) of `split` to `out`; the range must be in bounds.
  virtual void read(Split split, int64_t begin, int64_t count, uint16_t* out) const = 0;
  /// What the source is, for messages and logs, e.g. "text:corpus.txt".
  virtual std::string describe() const = 0;

  /// The next training batch; advances the position (crossing epochs as needed).
  Batch next_batch(int batch, int seq);
  /// Val batch number `index` (taken modulo val_batch_count); does not touch the position.
  Batch val_batch(int64_t index, int batch, int seq) const;
  /// Distinct val batches of this shape: the val windows / batch, at least 1 (when the val split
  /// holds fewer than `batch` windows, its one batch repeats windows).
  int64_t val_batch_count(int batch, int seq) const;

  /// Where the training reader stands now (store it in a checkpoint).
  DataPosition position() const { return position_; }
  /// Restores a position from position(); the following batches equal those read after it, for
  /// the same source and seq (the seed only sets the first epoch's RNG state).
  void set_position(const DataPosition& position);

 private:
  void check_batch_shape(Split split, int batch, int seq) const;

  DataPosition position_;
};

/// Parses a data spec: "builtin", "text:PATH" or "bin:GLOB" (llm.c shards). Throws octet::Error
/// naming the problem (unknown spec, missing, empty or binary text file, bad shard header or
/// size, shards without tokens, ...).
std::unique_ptr<TokenSource> make_token_source(const std::string& spec, uint64_t seed);

// ----------------------------------------------------------------------------
// The builtin corpus and its arithmetic evaluation

/// Seed of the builtin corpus text (fixed: every run trains on the same corpus).
inline constexpr uint64_t kBuiltinCorpusSeed = 0x6f63746574'0001ULL;
/// Default seed of the held-out arithmetic prompts; differs from the corpus seed.
inline constexpr uint64_t kArithmeticEvalSeed = 0x6f63746574'0002ULL;
/// Size of the builtin corpus: 2 MiB of byte tokens.
inline constexpr int64_t kBuiltinCorpusBytes = int64_t{1} << 21;
/// Longest answer of a builtin problem ("9801" = 99*99) plus the newline that ends it.
inline constexpr int kArithmeticMaxNewTokens = 5;

/// The builtin corpus text: lines of arithmetic on 0..99 ("37+48=85", "12-37=-25", "6*7=42")
/// mixed with templated English sentences, generated from kBuiltinCorpusSeed.
std::string builtin_corpus_text();

/// A prompt such as "37+48=" and its exact answer "85".
struct ArithmeticProblem {
  std::string prompt;
  std::string answer;
};
/// `count` problems drawn like the corpus lines (same operators and operand range) from `seed`.
/// Operands are 0..99, so the problem space is small (3 x 100 x 100): "held out" means drawn
/// independently of the corpus, not unseen in it.
std::vector<ArithmeticProblem> arithmetic_problems(int count, uint64_t seed = kArithmeticEvalSeed);

/// Model-side generation supplied by the trainer: returns only the text generated after `prompt`
/// (at most max_new_tokens byte tokens).
using GenerateFn = std::function<std::string(const std::string& prompt, int max_new_tokens)>;
/// Fraction of `count` problems whose generated text, up to its first newline, equals the answer
/// exactly. Calls generate(prompt, kArithmeticMaxNewTokens) once per problem.
double evaluate_arithmetic(const GenerateFn& generate, int count,
                           uint64_t seed = kArithmeticEvalSeed);

}  // namespace octet::train
