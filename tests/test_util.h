// Shared test helpers: fresh random inputs, the backends to run, exact comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "octet/core/error.h"
#include "octet/core/tensor.h"
#include "octet/fp8/format.h"

namespace octet::testing {

/// The next seed of the running test's stream. The stream is fixed by the test's full name
/// (suite, test and parameter), so every run draws the same inputs; OCTET_TEST_SEED=N mixes N
/// into every test's stream and OCTET_TEST_SEED=random mixes in a number drawn once per run (both
/// to explore other inputs). Successive calls in one test return different seeds. The first call
/// records the test's seed (the "seed" property of --gtest_output) and prints it: at once, or
/// with --gtest_brief only when the test fails, with the setting that replays it.
uint64_t fresh_seed();

/// The backends a parity test runs on: "cpu" always, "cuda:0" always listed (the case skips
/// itself without a GPU, so the suite's shape is the same everywhere).
std::vector<Device> all_backends();
/// A backend's name as test case names spell it ("cpu", "cuda0").
inline std::string device_name(const Device& d) {
  return d.is_cpu() ? "cpu" : "cuda" + std::to_string(d.index);
}
/// GTEST_SKIP()s the calling test when `device` is a GPU that is not there.
#define OCTET_SKIP_IF_UNAVAILABLE(device)                                              \
  do {                                                                                 \
    if ((device).is_cuda() && ::octet::cuda_device_count() <= (device).index)          \
      GTEST_SKIP() << (device) << " not available (" << ::octet::cuda_device_count()   \
                   << " GPU(s) visible)";                                              \
  } while (false)

/// True when OCTET_TEST_SMALL is set (the sanitizer runs of scripts/gpu-check.sh): parity suites
/// then leave out their large GPU-only shapes, which instrumentation would make far too slow.
bool small_tests_only();

/// How many runs a repeatability test makes: OCTET_TEST_REPEATS when it is at least 2, else
/// `fallback` (a longer soak sets it higher).
int repeats(int fallback);

/// CPU tensor of `shape` and dtype f32 or bf16 with values uniform in [-scale, scale] (never all
/// zero: a zero draw is replaced by scale/3).
Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, float scale = 1.0f);
/// CPU tensor with small integers in [-range, range] (exact in every format octet computes in).
Tensor random_int_tensor(const Shape& shape, DType dtype, uint64_t seed, int range = 4);
/// Values of a f32/bf16/fp8 tensor (any device) as floats, copied to the host.
std::vector<float> to_floats(const Tensor& t);
/// Raw bytes of a tensor (any device), copied to the host.
std::vector<uint8_t> to_bytes(const Tensor& t);

/// Asserts byte-for-byte equality and reports the first differing element.
::testing::AssertionResult bitwise_equal(const Tensor& expected, const Tensor& actual);

/// Runs `fn` and returns the octet::Error message it throws ("(no error thrown)" and a failure
/// when none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an octet::Error";
  return "(no error thrown)";
}

/// Relative L2 error ||a - b|| / ||b|| (b is the reference).
double relative_l2(const std::vector<float>& a, const std::vector<float>& reference);
/// Largest |a - b|.
double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b);

/// What a shell command did: its exit code (128 + the signal's number when a signal ended it; -1
/// when it could not start) and what it wrote to its stdout (redirect stderr in the command).
struct ShellResult {
  int exit_code = -1;
  std::string output;
};
ShellResult run_shell(const std::string& command);

}  // namespace octet::testing
