#include "test_util.h"

#include <sys/wait.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "octet/core/hash.h"

namespace octet::testing {

namespace {

// One splitmix64 step (its increment, then the finalizer): spreads any input over all 64 bits.
uint64_t mix64(uint64_t z) { return octet::mix64(z + 0x9e3779b97f4a7c15ULL); }

// A fixed hash of the test's name, the same with every standard library.
uint64_t name_hash(const std::string& name) { return fnv1a(name); }

/// What OCTET_TEST_SEED asks for: nothing (seeds from the test names alone), a number, or a
/// number drawn once for the whole run ("random").
struct RunSeed {
  bool set = false;
  uint64_t value = 0;
};

/// The --gtest_repeat iteration running (0 without repeats). With OCTET_TEST_SEED=N, iteration i
/// uses N + i, so one process sweeps consecutive seeds; unset, every iteration draws the same.
int iteration = 0;

uint64_t effective_run_seed(const RunSeed& run) { return run.value + iteration; }

const RunSeed& run_seed() {
  static const RunSeed seed = [] {
    const char* text = std::getenv("OCTET_TEST_SEED");
    if (text == nullptr || text[0] == '\0') return RunSeed{};
    if (std::string(text) == "random") {
      std::random_device device;
      return RunSeed{true, (static_cast<uint64_t>(device()) << 32) ^ device()};
    }
    char* end = nullptr;
    errno = 0;
    const uint64_t value = std::strtoull(text, &end, 0);
    if (errno != 0 || *end != '\0' || text[0] == '-')
      OCTET_ERROR("OCTET_TEST_SEED: expected an unsigned integer or 'random', got '", text, "'");
    return RunSeed{true, value};
  }();
  return seed;
}

/// The running test's seed stream; reset when a test starts.
struct TestSeeds {
  std::string test;    ///< full name, "Suite/Instance.Test/Param"
  bool drawn = false;  ///< fresh_seed was called in this test
  uint64_t base = 0;   ///< the test's seed (the first one it draws)
  uint64_t calls = 0;
} current;

std::string current_test_name() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return info ? std::string(info->test_suite_name()) + "." + info->name() : std::string();
}

std::string seed_line(const TestSeeds& s) {
  const RunSeed& run = run_seed();
  return "[   SEED   ] " + s.test + " seed " + std::to_string(s.base) +
         (run.set ? " (OCTET_TEST_SEED=" + std::to_string(effective_run_seed(run)) + " replays it)"
                  : " (from the test name; OCTET_TEST_SEED unset replays it)");
}

/// Resets the stream at each test's start and names the seed of a failed test.
class SeedListener : public ::testing::EmptyTestEventListener {
  void OnTestIterationStart(const ::testing::UnitTest&, int i) override { iteration = i; }
  void OnTestStart(const ::testing::TestInfo&) override { current = TestSeeds{}; }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (current.drawn && info.result()->Failed() && GTEST_FLAG_GET(brief))
      std::printf("%s\n", seed_line(current).c_str());
  }
};

// Registered before main (gtest_main) runs the tests; the listener list owns it.
const bool seed_listener_registered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new SeedListener);
  return true;
}();

}  // namespace

uint64_t fresh_seed() {
  if (!current.drawn) {
    const RunSeed& run = run_seed();  // may throw (a bad OCTET_TEST_SEED) before anything is set
    current.test = current_test_name();
    const uint64_t name = name_hash(current.test);
    current.base = run.set ? mix64(name ^ mix64(effective_run_seed(run))) : mix64(name);
    current.drawn = true;
    if (::testing::UnitTest::GetInstance()->current_test_info() != nullptr)
      ::testing::Test::RecordProperty("seed", std::to_string(current.base));
    if (!GTEST_FLAG_GET(brief)) std::printf("%s\n", seed_line(current).c_str());
  }
  // The first call returns the test's seed itself, so the printed number is the one traced.
  return current.calls++ == 0 ? current.base : mix64(current.base + current.calls);
}

bool small_tests_only() {
  const char* value = std::getenv("OCTET_TEST_SMALL");
  return value != nullptr && value[0] != '\0' && std::string(value) != "0";
}

int repeats(int fallback) {
  const char* env = std::getenv("OCTET_TEST_REPEATS");
  const int n = env != nullptr ? std::atoi(env) : 0;
  return n >= 2 ? n : fallback;
}

std::vector<Device> all_backends() { return {Device::cpu(), Device::cuda(0)}; }

namespace {
void store(Tensor& t, int64_t i, float v) {
  if (t.dtype() == DType::f32) {
    t.data<float>()[i] = v;
  } else {
    static_cast<uint16_t*>(t.raw_data())[i] = fp8::encode_bf16(v);
  }
}
}  // namespace

Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, float scale) {
  OCTET_CHECK(dtype == DType::f32 || dtype == DType::bf16, "random_tensor: f32 or bf16");
  Tensor t = Tensor::empty(shape, dtype);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  for (int64_t i = 0; i < t.numel(); ++i) {
    float v = dist(rng);
    store(t, i, v == 0.0f ? scale / 3 : v);
  }
  return t;
}

Tensor random_int_tensor(const Shape& shape, DType dtype, uint64_t seed, int range) {
  OCTET_CHECK(dtype == DType::f32 || dtype == DType::bf16, "random_int_tensor: f32 or bf16");
  Tensor t = Tensor::empty(shape, dtype);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dist(-range, range);
  bool any_nonzero = false;
  for (int64_t i = 0; i < t.numel(); ++i) {
    int v = dist(rng);
    any_nonzero |= v != 0;
    store(t, i, static_cast<float>(v));
  }
  if (!any_nonzero && t.numel() > 0) store(t, 0, 1.0f);
  return t;
}

std::vector<uint8_t> to_bytes(const Tensor& t) {
  Tensor host = t.device().is_cpu() ? t : t.to(Device::cpu());
  const auto* p = static_cast<const uint8_t*>(host.raw_data());
  return std::vector<uint8_t>(p, p + host.nbytes());
}

std::vector<float> to_floats(const Tensor& t) {
  std::vector<uint8_t> bytes = to_bytes(t);
  std::vector<float> out(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype()) {
      case DType::f32:
        std::memcpy(&out[i], &bytes[4 * i], 4);
        break;
      case DType::bf16: {
        uint16_t v;
        std::memcpy(&v, &bytes[2 * i], 2);
        out[i] = fp8::decode_bf16(v);
        break;
      }
      case DType::e4m3:
        out[i] = fp8::decode_e4m3(bytes[i]);
        break;
      case DType::e5m2:
        out[i] = fp8::decode_e5m2(bytes[i]);
        break;
      case DType::e8m0:
        out[i] = fp8::decode_e8m0(bytes[i]);
        break;
      default:
        OCTET_ERROR("to_floats: unsupported dtype ", dtype_name(t.dtype()));
    }
  }
  return out;
}

::testing::AssertionResult bitwise_equal(const Tensor& expected, const Tensor& actual) {
  if (expected.shape() != actual.shape() || expected.dtype() != actual.dtype())
    return ::testing::AssertionFailure()
           << "expected " << expected.describe() << ", got " << actual.describe();
  std::vector<uint8_t> a = to_bytes(expected), b = to_bytes(actual);
  const size_t element = dtype_size(expected.dtype());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) {
      size_t e = i / element;
      auto fail = ::testing::AssertionFailure();
      fail << "first difference at element " << e << " of " << expected.numel() << " ("
           << expected.describe() << "): bytes";
      for (size_t j = 0; j < element; ++j)
        fail << " " << std::hex << int(a[e * element + j]) << "/" << int(b[e * element + j]);
      return fail;
    }
  }
  return ::testing::AssertionSuccess();
}

double relative_l2(const std::vector<float>& a, const std::vector<float>& reference) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double d = double(a[i]) - double(reference[i]);
    num += d * d;
    den += double(reference[i]) * reference[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
  return m;
}

ShellResult run_shell(const std::string& command) {
  ShellResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

}  // namespace octet::testing
