// What the GPT model's tests share: a CPU-sized model, random tokens, the precisions by name.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "octet/train/model.h"

namespace octet::train::model_test {

/// A model small enough for the CPU whose GEMMs all fit the FP8 shape rule (multiples of 16).
inline ModelConfig micro(Arch arch, int64_t layers = 2) {
  ModelConfig c;
  c.preset = "micro";
  c.arch = arch;
  c.layers = layers;
  c.dim = 32;
  c.heads = 2;
  c.ffn = 64;
  c.vocab = 32;
  c.max_seq = 16;
  return c;
}
inline constexpr int64_t kBatch = 2;
inline constexpr int64_t kSeq = 8;
inline constexpr int64_t kRows = kBatch * kSeq;

/// i32 [n] tokens uniform in [0, vocab).
inline Tensor random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  Tensor t = Tensor::empty({n}, DType::i32);
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < n; ++i) t.data<int32_t>()[i] = static_cast<int32_t>(rng() % vocab);
  return t;
}

inline std::vector<std::string> precision_names() {
  return {"fp32", "bf16", "fp8-delayed", "fp8-current", "fp8-block", "fp8-mxfp8"};
}

inline std::string test_name(std::string name) {
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

}  // namespace octet::train::model_test
