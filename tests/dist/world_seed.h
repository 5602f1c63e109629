// The seed of a test that every rank runs together.
#pragma once

#include <cstdint>
#include <span>

#include "octet/dist/communicator.h"
#include "test_util.h"

namespace octet::testing {

/// The test's seed (fresh_seed: fixed by the test's name, varied by OCTET_TEST_SEED, printed),
/// drawn on rank 0 and broadcast: the ranks must draw the same inputs, and OCTET_TEST_SEED=random
/// resolves to another number in each process.
inline uint64_t world_seed(dist::Communicator& comm) {
  Tensor seed = Tensor::zeros({1}, DType::i64);
  if (comm.rank() == 0) *seed.data<int64_t>() = static_cast<int64_t>(fresh_seed());
  comm.broadcast(std::span(&seed, 1), 0);
  return static_cast<uint64_t>(*seed.data<int64_t>());
}

}  // namespace octet::testing
