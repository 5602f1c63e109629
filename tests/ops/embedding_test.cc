// Tests of the embedding family on every backend: embedding_forward and embedding_backward against
// references of the documented order (bit for bit) and float64 (within the float bound),
// cross_entropy against float64, finite differences on the CPU, byte-for-byte repeatability on
// CUDA with heavily repeated ids, ignored targets, and the messages for bad input.
#include "octet/ops/embedding.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "octet/core/determinism.h"
#include "ops/embedding_backend.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using testing::bitwise_equal;
using testing::device_name;
using testing::expect_error;
using testing::fresh_seed;
using testing::make_tensor;
using testing::on;
using testing::representable;
using testing::to_bytes;
using testing::to_floats;

// ----------------------------------------------------------------------------
// Helpers

Tensor int_tensor(const std::vector<int32_t>& values, const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::i32);
  if (!values.empty()) std::memcpy(t.raw_data(), values.data(), values.size() * sizeof(int32_t));
  return t;
}

std::vector<int32_t> uniform_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = dist(rng);
  return ids;
}

/// Zipf-like ids (rank k drawn with weight 1 / (k + 1)^1.1, as natural-language tokens roughly
/// are), the ranks scattered over the vocabulary: a few ids repeat thousands of times.
std::vector<int32_t> skewed_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> weights(vocab);
  for (int64_t k = 0; k < vocab; ++k) weights[k] = 1.0 / std::pow(static_cast<double>(k + 1), 1.1);
  std::discrete_distribution<int32_t> rank(weights.begin(), weights.end());
  std::vector<int32_t> label(vocab);
  std::iota(label.begin(), label.end(), 0);
  std::shuffle(label.begin(), label.end(), rng);
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = label[rank(rng)];
  return ids;
}

/// Requests determinism for one scope (the API flag).
struct DeterministicScope {
  DeterministicScope() { set_deterministic(true); }
  ~DeterministicScope() { set_deterministic(false); }
};

// ----------------------------------------------------------------------------
// embedding_forward

struct ForwardCase {
  Device backend;
  DType out;
  int64_t batch, seq, vocab, dim;
  bool positions;
  bool ids_2d;  ///< ids shaped [batch, seq] instead of [batch*seq]
};

std::string forward_name(const ::testing::TestParamInfo<ForwardCase>& info) {
  const ForwardCase& p = info.param;
  return device_name(p.backend) + "_" + std::string(dtype_name(p.out)) + "_" +
         std::to_string(p.batch) + "x" + std::to_string(p.seq) + "_v" + std::to_string(p.vocab) +
         "_d" + std::to_string(p.dim) + (p.positions ? "_wpe" : "") + (p.ids_2d ? "_ids2d" : "");
}

std::vector<ForwardCase> forward_cases() {
  std::vector<ForwardCase> cases;
  for (const Device& d : testing::all_backends())
    for (DType out : {DType::f32, DType::bf16}) {
      cases.push_back({d, out, 3, 7, 50, 33, true, false});
      cases.push_back({d, out, 1, 1, 1, 3221, true, false});
      cases.push_back({d, out, 2333, 1, 17, 1, true, true});
      cases.push_back({d, out, 4, 37, 1481, 677, true, false});
      cases.push_back({d, out, 5, 11, 300, 64, false, true});
    }
  return cases;
}

using EmbeddingForward = testing::SeededParityTest<ForwardCase>;

TEST_P(EmbeddingForward, EqualsTokenPlusPositionRowsBitwise) {
  const ForwardCase& p = GetParam();
  const int64_t rows = p.batch * p.seq;
  const int64_t max_seq = p.seq + 3;  // longer than seq: only the first seq rows are used
  const std::vector<int32_t> ids = uniform_ids(rows, p.vocab, seed);
  const Tensor wte = testing::random_tensor({p.vocab, p.dim}, DType::f32, seed + 1);
  const Tensor wpe =
      p.positions ? testing::random_tensor({max_seq, p.dim}, DType::f32, seed + 2) : Tensor();
  const Shape id_shape = p.ids_2d ? Shape{p.batch, p.seq} : Shape{rows};
  Tensor out = Tensor::empty({rows, p.dim}, p.out, p.backend);

  ops::embedding_forward(on(int_tensor(ids, id_shape), p.backend), on(wte, p.backend),
                         p.positions ? on(wpe, p.backend) : Tensor(), p.seq, out);

  // The exact sum of two floats rounded once to f32 (a double holds it exactly), then to bf16.
  std::vector<float> expected(rows * p.dim);
  const float* w = wte.data<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < p.dim; ++c) {
      const double token = w[ids[r] * p.dim + c];
      const double position = p.positions ? wpe.data<float>()[(r % p.seq) * p.dim + c] : 0.0;
      expected[r * p.dim + c] = representable(static_cast<float>(token + position), p.out);
    }
  EXPECT_TRUE(bitwise_equal(make_tensor(expected, {rows, p.dim}, p.out), out));
}

INSTANTIATE_TEST_SUITE_P(Ops, EmbeddingForward, ::testing::ValuesIn(forward_cases()), forward_name);

// ----------------------------------------------------------------------------
// embedding_backward

struct BackwardCase {
  Device backend;
  DType dout;
  int64_t batch, seq, vocab, dim;
  bool positions;
  bool skewed;  ///< Zipf-like ids (heavy repetition) instead of uniform
};

std::string backward_name(const ::testing::TestParamInfo<BackwardCase>& info) {
  const BackwardCase& p = info.param;
  return device_name(p.backend) + "_" + std::string(dtype_name(p.dout)) + "_" +
         std::to_string(p.batch) + "x" + std::to_string(p.seq) + "_v" + std::to_string(p.vocab) +
         "_d" + std::to_string(p.dim) + (p.positions ? "_wpe" : "") + (p.skewed ? "_skewed" : "");
}

std::vector<BackwardCase> backward_cases() {
  std::vector<BackwardCase> cases;
  for (const Device& d : testing::all_backends())
    for (DType dout : {DType::f32, DType::bf16}) {
      cases.push_back({d, dout, 4, 16, 10, 33, true, true});
      cases.push_back({d, dout, 1, 1, 1, 3221, true, false});
      cases.push_back({d, dout, 2333, 1, 5, 1, true, false});
      cases.push_back({d, dout, 8, 64, 1481, 677, true, true});
      cases.push_back({d, dout, 3, 5, 700, 2, false, false});  // most vocab rows unused
    }
  return cases;
}

using EmbeddingBackward = testing::SeededParityTest<BackwardCase>;

TEST_P(EmbeddingBackward, SumsInIncreasingRowOrderBitwiseAndCloseToFloat64) {
  const BackwardCase& p = GetParam();
  const int64_t rows = p.batch * p.seq;
  const int64_t max_seq = p.seq + 2;
  const std::vector<int32_t> ids =
      p.skewed ? skewed_ids(rows, p.vocab, seed) : uniform_ids(rows, p.vocab, seed);
  const Tensor dout = testing::random_tensor({rows, p.dim}, p.dout, seed + 1);
  // Nonzero starting gradients: the op accumulates.
  const Tensor dwte0 = testing::random_tensor({p.vocab, p.dim}, DType::f32, seed + 2);
  const Tensor dwpe0 = testing::random_tensor({max_seq, p.dim}, DType::f32, seed + 3);
  Tensor dwte = dwte0.to(p.backend);
  Tensor dwpe = p.positions ? dwpe0.to(p.backend) : Tensor();

  ops::embedding_backward(on(int_tensor(ids, {rows}), p.backend), on(dout, p.backend), p.seq, dwte,
                          dwpe);

  const std::vector<float> g = to_floats(dout);
  // The documented order: per vocab row, acc = 0, then its rows in increasing order, then
  // dwte[v] += acc. Walking the rows in order and adding into acc[id] is exactly that.
  const int64_t vocab = p.vocab, dim = p.dim;
  std::vector<float> acc(vocab * dim, 0.0f);
  std::vector<double> exact(vocab * dim, 0.0), magnitude(vocab * dim, 0.0);
  std::vector<int64_t> count(vocab, 0);
  for (int64_t r = 0; r < rows; ++r) {
    ++count[ids[r]];
    for (int64_t c = 0; c < dim; ++c) {
      acc[ids[r] * dim + c] += g[r * dim + c];
      exact[ids[r] * dim + c] += g[r * dim + c];
      magnitude[ids[r] * dim + c] += std::fabs(g[r * dim + c]);
    }
  }
  std::vector<float> expected = to_floats(dwte0);
  const std::vector<float> got = to_floats(dwte);
  for (int64_t v = 0; v < vocab; ++v) {
    if (count[v] == 0) continue;  // untouched
    for (int64_t c = 0; c < dim; ++c) {
      const int64_t i = v * dim + c;
      const double reference = static_cast<double>(expected[i]) + exact[i];
      // Sequential float summation: error <= (terms) * eps * (sum of magnitudes).
      const double bound = (count[v] + 1) * FLT_EPSILON * (magnitude[i] + std::fabs(expected[i]));
      EXPECT_NEAR(got[i], reference, bound) << "dwte[" << v << ", " << c << "]";
      expected[i] += acc[i];
    }
  }
  EXPECT_TRUE(bitwise_equal(Tensor::from_vector(expected, {vocab, dim}), dwte));

  if (p.positions) {
    std::vector<float> expected_wpe = to_floats(dwpe0);
    const std::vector<float> got_wpe = to_floats(dwpe);
    for (int64_t t = 0; t < p.seq; ++t)
      for (int64_t c = 0; c < dim; ++c) {
        float sum = 0.0f;
        double exact_sum = 0.0, mag = 0.0;
        for (int64_t b = 0; b < p.batch; ++b) {
          sum += g[(b * p.seq + t) * dim + c];
          exact_sum += g[(b * p.seq + t) * dim + c];
          mag += std::fabs(g[(b * p.seq + t) * dim + c]);
        }
        const int64_t i = t * dim + c;
        const double reference = static_cast<double>(expected_wpe[i]) + exact_sum;
        EXPECT_NEAR(got_wpe[i], reference,
                    (p.batch + 1) * FLT_EPSILON * (mag + std::fabs(expected_wpe[i])));
        expected_wpe[i] += sum;
      }
    // Rows seq.. of dwpe (beyond seq) keep their starting values.
    EXPECT_TRUE(bitwise_equal(Tensor::from_vector(expected_wpe, {max_seq, dim}), dwpe));
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, EmbeddingBackward, ::testing::ValuesIn(backward_cases()),
                         backward_name);

// ----------------------------------------------------------------------------
// Finite differences (CPU): backward is the adjoint of forward

TEST(EmbeddingGradCheck, BackwardMatchesFiniteDifferencesOfForward) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr int64_t kBatch = 3, kSeq = 4, kVocab = 6, kDim = 5;
  constexpr int64_t kRows = kBatch * kSeq;
  // A power of two: the perturbed weights are exact, and forward is linear in them.
  constexpr float kStep = 0.0625f;
  std::vector<int32_t> ids = uniform_ids(kRows, kVocab - 1, seed);  // id kVocab-1 never used
  ids[0] = ids[5] = ids[11] = 2;                                    // repeated
  const Tensor id_tensor = int_tensor(ids, {kRows});
  Tensor wte = testing::random_tensor({kVocab, kDim}, DType::f32, seed + 1);
  Tensor wpe = testing::random_tensor({kSeq, kDim}, DType::f32, seed + 2);
  const Tensor weights = testing::random_tensor({kRows, kDim}, DType::f32, seed + 3);

  // loss = sum(out * weights); d loss / d out = weights.
  auto loss = [&] {
    Tensor out = Tensor::empty({kRows, kDim}, DType::f32);
    ops::embedding_forward(id_tensor, wte, wpe, kSeq, out);
    double sum = 0.0;
    for (int64_t i = 0; i < out.numel(); ++i)
      sum += static_cast<double>(out.data<float>()[i]) * weights.data<float>()[i];
    return sum;
  };
  Tensor dwte = Tensor::zeros({kVocab, kDim}, DType::f32);
  Tensor dwpe = Tensor::zeros({kSeq, kDim}, DType::f32);
  ops::embedding_backward(id_tensor, weights, kSeq, dwte, dwpe);

  for (Tensor* table : {&wte, &wpe}) {
    const Tensor& grad = table == &wte ? dwte : dwpe;
    for (int64_t i = 0; i < table->numel(); ++i) {
      float& w = table->data<float>()[i];
      const float saved = w;
      w = saved + kStep;
      const double up = loss();
      w = saved - kStep;
      const double down = loss();
      w = saved;
      const double numeric = (up - down) / (2.0 * kStep);
      EXPECT_NEAR(grad.data<float>()[i], numeric, 1e-4 * (1.0 + std::fabs(numeric)))
          << (table == &wte ? "wte" : "wpe") << " element " << i;
    }
  }
  for (int64_t c = 0; c < kDim; ++c)
    EXPECT_EQ(dwte.data<float>()[(kVocab - 1) * kDim + c], 0.0f) << "unused id got a gradient";
}

// ----------------------------------------------------------------------------
// cross_entropy

struct CrossEntropyCase {
  Device backend;
  DType dtype;
  int64_t rows, vocab;
  bool with_grad;
};

std::string cross_entropy_name(const ::testing::TestParamInfo<CrossEntropyCase>& info) {
  const CrossEntropyCase& p = info.param;
  return device_name(p.backend) + "_" + std::string(dtype_name(p.dtype)) + "_" +
         std::to_string(p.rows) + "x" + std::to_string(p.vocab) + (p.with_grad ? "_grad" : "");
}

std::vector<CrossEntropyCase> cross_entropy_cases() {
  std::vector<CrossEntropyCase> cases;
  for (const Device& d : testing::all_backends())
    for (DType dtype : {DType::f32, DType::bf16}) {
      cases.push_back({d, dtype, 1, 3221, true});
      cases.push_back({d, dtype, 2333, 1, true});
      cases.push_back({d, dtype, 1481, 677, true});
      cases.push_back({d, dtype, 7, 65536, true});
      cases.push_back({d, dtype, 33, 50304, true});
      cases.push_back({d, dtype, 5, 1000, false});
    }
  return cases;
}

/// Targets uniform in [0, vocab), with every row r % 8 == 3 ignored (-1, or -100 as PyTorch's
/// ignore_index).
std::vector<int32_t> make_targets(int64_t rows, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> targets = uniform_ids(rows, vocab, seed);
  for (int64_t r = 3; r < rows; r += 8) targets[r] = (r / 8) % 2 ? -1 : -100;
  return targets;
}

using CrossEntropy = testing::SeededParityTest<CrossEntropyCase>;

TEST_P(CrossEntropy, MatchesFloat64SoftmaxAndIgnoresNegativeTargets) {
  const CrossEntropyCase& p = GetParam();
  // Logits in [-8, 8]: probabilities span e^-16, so the sums mix very different magnitudes.
  const Tensor logits = testing::random_tensor({p.rows, p.vocab}, p.dtype, seed, 8.0f);
  const std::vector<int32_t> targets = make_targets(p.rows, p.vocab, seed + 1);
  const float grad_scale = 1.0f / static_cast<float>(3 * p.rows);  // e.g. 3 accumulation steps
  Tensor losses = Tensor::empty({p.rows}, DType::f32, p.backend);
  Tensor dlogits = p.with_grad ? Tensor::empty({p.rows, p.vocab}, p.dtype, p.backend) : Tensor();

  ops::cross_entropy(on(logits, p.backend), on(int_tensor(targets, {p.rows}), p.backend), losses,
                     dlogits, grad_scale);

  const std::vector<float> l = to_floats(logits);
  const std::vector<float> loss = to_floats(losses);
  const std::vector<float> grad = p.with_grad ? to_floats(dlogits) : std::vector<float>();
  const std::vector<uint8_t> grad_bytes = p.with_grad ? to_bytes(dlogits) : std::vector<uint8_t>();
  // f32: exp and the fixed-order sum are good to ~1e-6 relative; bf16 gradients round to 8 bits.
  const double grad_rel = p.dtype == DType::bf16 ? 1.0 / 256 : 2e-5;
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* row = l.data() + r * p.vocab;
    const int32_t t = targets[r];
    if (t < 0) {
      EXPECT_EQ(fp8::float_bits(loss[r]), 0u) << "ignored row " << r << " loss " << loss[r];
      if (p.with_grad) {
        const size_t width = dtype_size(p.dtype) * p.vocab;
        const auto begin = grad_bytes.begin() + r * width;
        EXPECT_TRUE(std::all_of(begin, begin + width, [](uint8_t b) { return b == 0; }))
            << "ignored row " << r << " has a nonzero gradient";
      }
      continue;
    }
    const double m = *std::max_element(row, row + p.vocab);
    double s = 0.0;
    for (int64_t j = 0; j < p.vocab; ++j) s += std::exp(row[j] - m);
    const double reference = m + std::log(s) - row[t];
    ASSERT_TRUE(std::isfinite(loss[r])) << "row " << r;
    EXPECT_NEAR(loss[r], reference, 2e-5 + 2e-6 * std::fabs(reference)) << "row " << r;
    if (!p.with_grad) continue;
    for (int64_t j = 0; j < p.vocab; ++j) {
      const double prob = std::exp(row[j] - m) / s;
      const double expected = (prob - (j == t ? 1.0 : 0.0)) * grad_scale;
      const double tol =
          grad_rel * std::fabs(expected) + (j == t ? 2e-5 * grad_scale : 0.0) + 1e-30;
      ASSERT_NEAR(grad[r * p.vocab + j], expected, tol) << "dlogits[" << r << ", " << j << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, CrossEntropy, ::testing::ValuesIn(cross_entropy_cases()),
                         cross_entropy_name);

TEST(CrossEntropyGradCheck, GradientMatchesFiniteDifferencesOfTheLoss) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr int64_t kRows = 3, kVocab = 11;
  constexpr float kGradScale = 0.5f;
  constexpr float kStep = 1.0f / 64;  // exact; central differences err by O(h^2) ~ 1e-4 here
  Tensor logits = testing::random_tensor({kRows, kVocab}, DType::f32, seed, 2.0f);
  const Tensor targets = int_tensor({4, -1, 10}, {kRows});
  Tensor losses = Tensor::empty({kRows}, DType::f32);
  Tensor dlogits = Tensor::empty({kRows, kVocab}, DType::f32);
  ops::cross_entropy(logits, targets, losses, dlogits, kGradScale);
  const std::vector<float> grad = to_floats(dlogits);

  // d(grad_scale * sum of losses) / d logits.
  auto total = [&] {
    Tensor l = Tensor::empty({kRows}, DType::f32);
    ops::cross_entropy(logits, targets, l, Tensor(), kGradScale);
    double sum = 0.0;
    for (int64_t r = 0; r < kRows; ++r) sum += l.data<float>()[r];
    return kGradScale * sum;
  };
  for (int64_t i = 0; i < logits.numel(); ++i) {
    float& x = logits.data<float>()[i];
    const float saved = x;
    x = saved + kStep;
    const double up = total();
    x = saved - kStep;
    const double down = total();
    x = saved;
    EXPECT_NEAR(grad[i], (up - down) / (2.0 * kStep), 1e-3) << "logit " << i;
  }
}

TEST(CrossEntropyGradCheck, InPlaceGradientEqualsSeparateOutput) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Tensor logits = testing::random_tensor({9, 130}, DType::f32, seed, 4.0f);
  const Tensor targets = int_tensor(make_targets(9, 130, seed + 1), {9});
  Tensor losses = Tensor::empty({9}, DType::f32);
  Tensor dlogits = Tensor::empty({9, 130}, DType::f32);
  ops::cross_entropy(logits, targets, losses, dlogits, 0.25f);
  Tensor in_place = logits.clone();
  Tensor in_place_losses = Tensor::empty({9}, DType::f32);
  ops::cross_entropy(in_place, targets, in_place_losses, in_place, 0.25f);
  EXPECT_TRUE(bitwise_equal(losses, in_place_losses));
  EXPECT_TRUE(bitwise_equal(dlogits, in_place));
}

// ----------------------------------------------------------------------------
// CUDA: repeatability and agreement with the CPU at a training-sized shape

/// GPT-2 small's shape: 64 x 1024 tokens, padded vocabulary 50304, width 768 (llm.c).
constexpr int64_t kGptBatch = 64, kGptSeq = 1024, kGptVocab = 50304, kGptDim = 768;

/// Skips a GPU test at training scale under OCTET_TEST_SMALL (scripts/gpu-check.sh's sanitizer
/// runs, which leave out shapes above 2^22 elements).
#define OCTET_SKIP_IF_SMALL_ONLY()                                            \
  do {                                                                        \
    if (testing::small_tests_only())                                          \
      GTEST_SKIP() << "training-scale shape left out under OCTET_TEST_SMALL"; \
  } while (false)

TEST(EmbeddingCuda, BackwardIsRepeatableAsBytesAndEqualsCpuWithSkewedIds) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  OCTET_SKIP_IF_SMALL_ONLY();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t rows = kGptBatch * kGptSeq;
  const std::vector<int32_t> host_ids = skewed_ids(rows, kGptVocab, seed);
  const Tensor ids = int_tensor(host_ids, {rows});
  const Tensor dout = testing::random_tensor({rows, kGptDim}, DType::f32, seed + 1);
  const Tensor dwte0 = testing::random_tensor({kGptVocab, kGptDim}, DType::f32, seed + 2);
  const Tensor dwpe0 = testing::random_tensor({kGptSeq, kGptDim}, DType::f32, seed + 3);
  const Tensor gpu_ids = ids.to(gpu), gpu_dout = dout.to(gpu);

  std::vector<std::vector<uint8_t>> runs_wte, runs_wpe;
  for (int run = 0; run < 3; ++run) {
    Tensor dwte = dwte0.to(gpu), dwpe = dwpe0.to(gpu);
    ops::embedding_backward(gpu_ids, gpu_dout, kGptSeq, dwte, dwpe);
    const std::vector<float> values = to_floats(dwte);
    ASSERT_TRUE(
        std::all_of(values.begin(), values.end(), [](float x) { return std::isfinite(x); }));
    runs_wte.push_back(to_bytes(dwte));
    runs_wpe.push_back(to_bytes(dwpe));
  }
  for (int run = 1; run < 3; ++run) {
    EXPECT_TRUE(runs_wte[run] == runs_wte[0]) << "dwte of run " << run << " differs from run 0";
    EXPECT_TRUE(runs_wpe[run] == runs_wpe[0]) << "dwpe of run " << run << " differs from run 0";
  }
  Tensor cpu_wte = dwte0.clone(), cpu_wpe = dwpe0.clone();
  ops::embedding_backward(ids, dout, kGptSeq, cpu_wte, cpu_wpe);
  EXPECT_TRUE(to_bytes(cpu_wte) == runs_wte[0]) << "dwte differs from the CPU reference";
  EXPECT_TRUE(to_bytes(cpu_wpe) == runs_wpe[0]) << "dwpe differs from the CPU reference";
}

TEST(EmbeddingCuda, CrossEntropyIsRepeatableAsBytes) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  OCTET_SKIP_IF_SMALL_ONLY();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr int64_t kRows = 1024;
  const Tensor logits = testing::random_tensor({kRows, kGptVocab}, DType::bf16, seed, 8.0f).to(gpu);
  const Tensor targets = int_tensor(make_targets(kRows, kGptVocab, seed + 1), {kRows}).to(gpu);
  std::vector<uint8_t> first_loss, first_grad;
  for (int run = 0; run < 3; ++run) {
    Tensor losses = Tensor::empty({kRows}, DType::f32, gpu);
    Tensor dlogits = Tensor::empty({kRows, kGptVocab}, DType::bf16, gpu);
    ops::cross_entropy(logits, targets, losses, dlogits, 1.0f / kRows);
    if (run == 0) {
      first_loss = to_bytes(losses);
      first_grad = to_bytes(dlogits);
      continue;
    }
    EXPECT_TRUE(to_bytes(losses) == first_loss) << "losses of run " << run << " differ";
    EXPECT_TRUE(to_bytes(dlogits) == first_grad) << "dlogits of run " << run << " differ";
  }
}

/// A bf16 row of 65536 or 65535 logits (128 KiB) fits in the shared memory a CTA may opt into on
/// an H100/H200 (227 KiB) and takes the staged kernel: by 16-byte packs when aligned, element by
/// element at an odd offset or an odd vocabulary, and in place. The same values as f32 (256 KiB a
/// row, more than any GPU's opt-in) take the three-pass kernel. Both do the same operations on the
/// same floats, so the losses are the same bits and the bf16 gradient is the f32 gradient rounded
/// to bf16. (On a GPU with less shared memory both take the three-pass kernel.)
TEST(EmbeddingCuda, CrossEntropyStagedRowsEqualThreePassRows) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr int64_t kRows = 24;
  const float grad_scale = 1.0f / (3 * kRows);
  for (const int64_t vocab : {int64_t{65536}, int64_t{65535}}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    const Tensor logits = testing::random_tensor({kRows, vocab}, DType::bf16, seed, 8.0f);
    const Tensor targets = int_tensor(make_targets(kRows, vocab, seed + 1), {kRows}).to(gpu);
    const Tensor logits32 = make_tensor(to_floats(logits), {kRows, vocab}, DType::f32).to(gpu);
    Tensor losses32 = Tensor::empty({kRows}, DType::f32, gpu);
    Tensor dlogits32 = Tensor::empty({kRows, vocab}, DType::f32, gpu);
    ops::cross_entropy(logits32, targets, losses32, dlogits32, grad_scale);
    const std::vector<uint8_t> want_losses = to_bytes(losses32);
    // The f32 gradient rounded to bf16 (make_tensor rounds to nearest even, as the kernel does).
    const std::vector<uint8_t> want_grad =
        to_bytes(make_tensor(to_floats(dlogits32), {kRows, vocab}, DType::bf16));

    const auto expect_three_pass_bits = [&](const Tensor& l, const Tensor& d, const char* what) {
      Tensor losses = Tensor::empty({kRows}, DType::f32, gpu);
      ops::cross_entropy(l, targets, losses, d, grad_scale);
      EXPECT_TRUE(to_bytes(losses) == want_losses) << what << ": losses differ";
      EXPECT_TRUE(to_bytes(d) == want_grad) << what << ": dlogits differ";
    };
    expect_three_pass_bits(logits.to(gpu), Tensor::empty({kRows, vocab}, DType::bf16, gpu),
                           "aligned");
    const Tensor in_place = logits.to(gpu);
    expect_three_pass_bits(in_place, in_place, "in place");
    // Views 2 bytes past a 16-byte boundary: no 16-byte packs.
    const auto odd_view = [&] {
      return Tensor::empty({kRows * vocab + 1}, DType::bf16, gpu)
          .slice(1, kRows * vocab + 1)
          .view({kRows, vocab});
    };
    Tensor odd = odd_view();
    odd.copy_from(logits);
    expect_three_pass_bits(odd, odd_view(), "odd offset");
  }
}

/// Sets an environment variable for one scope, then restores what was there.
class EnvScope {
 public:
  EnvScope(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    had_ = std::getenv(name) != nullptr;
    setenv(name, value, 1);
  }
  ~EnvScope() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(EmbeddingCuda, BadIdsThrowWhenCheckedAndPoisonTheRowOtherwise) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  constexpr int64_t kVocab = 7, kDim = 5, kRows = 12;
  std::vector<int32_t> host_ids(kRows, 1);
  host_ids[9] = -3;
  host_ids[5] = kVocab;  // the lowest bad row is reported
  const Tensor ids = int_tensor(host_ids, {kRows}).to(gpu);
  const Tensor wte = testing::random_tensor({kVocab, kDim}, DType::f32, fresh_seed()).to(gpu);
  Tensor out = Tensor::empty({kRows, kDim}, DType::f32, gpu);
  {
    EnvScope env("OCTET_CHECK_IDS", "1");
    expect_error([&] { ops::embedding_forward(ids, wte, Tensor(), 4, out); },
                 {"embedding_forward", "ids[5] = 7", "[0, 7)"});
    Tensor dwte = Tensor::zeros({kVocab, kDim}, DType::f32, gpu);
    expect_error([&] { ops::embedding_backward(ids, out, 4, dwte, Tensor()); },
                 {"embedding_backward", "ids[5] = 7"});
  }
  {
    EnvScope env("OCTET_CHECK_IDS", "1");
    Tensor logits = testing::random_tensor({kRows, kVocab}, DType::f32, fresh_seed()).to(gpu);
    Tensor losses = Tensor::empty({kRows}, DType::f32, gpu);
    std::vector<int32_t> targets(kRows, 2);
    targets[4] = -1;      // ignored, not an error
    targets[8] = kVocab;  // out of range
    expect_error(
        [&] {
          ops::cross_entropy(logits, int_tensor(targets, {kRows}).to(gpu), losses, Tensor(), 1.0f);
        },
        {"cross_entropy", "targets[8] = 7", "[0, 7)"});
  }
  if (ops::check_ids_requested()) GTEST_SKIP() << "the environment requests checked ids";
  // Unchecked, also under determinism (a validation, not an ordering): no throw, NaN rows.
  DeterministicScope deterministic;
  ops::embedding_forward(ids, wte, Tensor(), 4, out);
  const std::vector<float> values = to_floats(out);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kDim; ++c)
      EXPECT_EQ(std::isnan(values[r * kDim + c]), r == 5 || r == 9) << "row " << r;
}

// ----------------------------------------------------------------------------
// Bad input

class EmbeddingBadInput : public ::testing::Test {
 protected:
  static constexpr int64_t kVocab = 7, kDim = 5, kSeq = 4, kRows = 8;
  Tensor ids = int_tensor({0, 1, 2, 3, 4, 5, 6, 0}, {kRows});
  Tensor wte = testing::random_tensor({kVocab, kDim}, DType::f32, 1);
  Tensor wpe = testing::random_tensor({kSeq, kDim}, DType::f32, 2);
  Tensor out = Tensor::empty({kRows, kDim}, DType::f32);
};

TEST_F(EmbeddingBadInput, ForwardNamesWhatIsWrong) {
  using ops::embedding_forward;
  expect_error([&] { embedding_forward(Tensor::zeros({kRows}, DType::f32), wte, wpe, kSeq, out); },
               {"embedding_forward", "ids must be i32", "got f32[8]"});
  expect_error([&] { embedding_forward(Tensor::empty({0}, DType::i32), wte, wpe, kSeq, out); },
               {"ids is an empty tensor"});
  expect_error([&] { embedding_forward(ids, wte, wpe, 3, out); },
               {"seq must divide the number of rows: got seq 3 for 8 ids"});
  expect_error([&] { embedding_forward(ids, wte, wpe, 0, out); }, {"seq must be >= 1, got 0"});
  expect_error(
      [&] {
        embedding_forward(ids.view({2, 4}), wte, wpe, 2, out);
      },
      {"must have 2 columns", "i32[2, 4]"});
  expect_error([&] { embedding_forward(ids, wte, wpe.slice(0, 3), kSeq, out); },
               {"wpe holds 3 positions, fewer than seq 4"});
  expect_error(
      [&] {
        embedding_forward(ids, wte, Tensor::zeros({kSeq, 6}, DType::f32), kSeq, out);
      },
      {"wpe must be f32[max_seq, 5]", "got f32[4, 6]"});
  expect_error(
      [&] {
        embedding_forward(ids, Tensor::zeros({kVocab, kDim}, DType::bf16), wpe, kSeq, out);
      },
      {"wte must be f32[rows, dim]", "got bf16[7, 5]"});
  expect_error(
      [&] {
        embedding_forward(ids, Tensor::empty({0, kDim}, DType::f32), wpe, kSeq, out);
      },
      {"wte is an empty tensor"});
  expect_error(
      [&] {
        embedding_forward(ids, wte, wpe, kSeq, Tensor::empty({kRows, 4}, DType::f32));
      },
      {"out must be [8, 5]", "got f32[8, 4]"});
  expect_error(
      [&] {
        embedding_forward(ids, wte, wpe, kSeq, Tensor::empty({kRows, kDim}, DType::i32));
      },
      {"unsupported dtype for out: expected f32 or bf16", "got i32[8, 5]"});
  expect_error(
      [&] {
        embedding_forward(int_tensor({0, 1, 7, 2}, {4}), wte, wpe, kSeq,
                          Tensor::empty({4, kDim}, DType::f32));
      },
      {"ids[2] = 7 is outside [0, 7) for a vocabulary of 7"});
  expect_error(
      [&] {
        embedding_forward(int_tensor({0, -1, 3, 2}, {4}), wte, wpe, kSeq,
                          Tensor::empty({4, kDim}, DType::f32));
      },
      {"ids[1] = -1 is outside [0, 7)"});
}

TEST_F(EmbeddingBadInput, BackwardNamesWhatIsWrong) {
  using ops::embedding_backward;
  Tensor dwte = Tensor::zeros({kVocab, kDim}, DType::f32);
  Tensor dwpe = Tensor::zeros({kSeq, kDim}, DType::f32);
  expect_error(
      [&] {
        embedding_backward(ids, Tensor::empty({kRows + 1, kDim}, DType::f32), kSeq, dwte, dwpe);
      },
      {"embedding_backward", "dout must be [8, 5]", "got f32[9, 5]"});
  expect_error(
      [&] {
        embedding_backward(ids, out, kSeq, Tensor::zeros({kVocab, kDim}, DType::bf16), dwpe);
      },
      {"dwte must be f32[rows, dim]"});
  expect_error([&] { embedding_backward(ids, out, 8, dwte, dwpe); },
               {"dwpe holds 4 positions, fewer than seq 8"});
  expect_error([&] { embedding_backward(ids, out, 5, dwte, dwpe); },
               {"seq must divide the number of rows: got seq 5 for 8 ids"});
  expect_error(
      [&] {
        embedding_backward(int_tensor({0, 9, 1, 2}, {4}), Tensor::zeros({4, kDim}, DType::f32),
                           kSeq, dwte, dwpe);
      },
      {"ids[1] = 9 is outside [0, 7)"});
}

TEST(CrossEntropyBadInput, NamesWhatIsWrong) {
  using ops::cross_entropy;
  const Tensor logits = testing::random_tensor({4, 11}, DType::f32, 3);
  const Tensor targets = int_tensor({1, 2, -1, 10}, {4});
  Tensor losses = Tensor::empty({4}, DType::f32);
  Tensor dlogits = Tensor::empty({4, 11}, DType::f32);
  expect_error(
      [&] {
        cross_entropy(logits, int_tensor({1, 2, 3}, {3}), losses, dlogits, 1.0f);
      },
      {"cross_entropy", "targets must be i32[4]", "got i32[3]"});
  expect_error(
      [&] { cross_entropy(logits, Tensor::zeros({4}, DType::f32), losses, dlogits, 1.0f); },
      {"targets must be i32[4]", "got f32[4]"});
  expect_error(
      [&] { cross_entropy(logits, targets, Tensor::empty({4}, DType::bf16), dlogits, 1.0f); },
      {"losses must be f32[4]", "got bf16[4]"});
  expect_error(
      [&] {
        cross_entropy(logits, targets, losses, Tensor::empty({4, 11}, DType::bf16), 1.0f);
      },
      {"dlogits must match logits f32[4, 11]", "got bf16[4, 11]"});
  expect_error([&] { cross_entropy(logits, targets, losses, dlogits, NAN); },
               {"grad_scale must be finite"});
  expect_error(
      [&] {
        cross_entropy(Tensor::empty({0, 11}, DType::f32), int_tensor({}, {0}),
                      Tensor::empty({0}, DType::f32), Tensor(), 1.0f);
      },
      {"logits is an empty tensor"});
  expect_error(
      [&] {
        cross_entropy(logits, int_tensor({1, 2, 11, 0}, {4}), losses, dlogits, 1.0f);
      },
      {"targets[2] = 11 is outside [0, 11)", "negative targets are allowed"});
}

TEST(EmbeddingDevices, MixedDevicesAreRefused) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const Tensor ids = int_tensor({0, 1}, {2});
  const Tensor wte = testing::random_tensor({3, 4}, DType::f32, 1);
  expect_error(
      [&] {
        ops::embedding_forward(ids, wte.to(gpu), Tensor(), 2,
                               Tensor::empty({2, 4}, DType::f32, gpu));
      },
      {"embedding_forward: all tensors must be on one device", "cpu", "cuda:0"});
  const Tensor logits = testing::random_tensor({2, 3}, DType::f32, 2);
  expect_error(
      [&] {
        ops::cross_entropy(logits.to(gpu), ids, Tensor::empty({2}, DType::f32, gpu), Tensor(),
                           1.0f);
      },
      {"cross_entropy: all tensors must be on one device"});
}

}  // namespace
}  // namespace octet
