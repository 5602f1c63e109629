// Shared by the token-source targets: what a source that loaded must then do.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fuzz_input.h"
#include "octet/train/data.h"

namespace octet::fuzz {

/// Every token of both splits is below vocab_size(), and small train and val batches read.
inline void exercise(train::TokenSource& source) {
  const int vocab = source.vocab_size();
  require(vocab >= 1 && vocab <= train::kMaxVocab, "vocab_size() is in [1, 65536]");
  for (train::Split split : {train::Split::train, train::Split::val}) {
    std::vector<uint16_t> tokens(static_cast<size_t>(source.size(split)));
    source.read(split, 0, static_cast<int64_t>(tokens.size()), tokens.data());
    require(std::all_of(tokens.begin(), tokens.end(), [&](uint16_t t) { return t < vocab; }),
            "every token id is below vocab_size()");
  }
  // Batches long enough to cross epochs of a small split; shapes the data cannot hold throw.
  for (int seq : {1, 7, 64}) {
    expect_clean([&] {
      for (int i = 0; i < 3; ++i) source.next_batch(2, seq);
    });
    expect_clean([&] { source.val_batch(5, 3, seq); });
  }
}

}  // namespace octet::fuzz
