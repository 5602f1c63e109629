#include "test_util.h"

#include <cmath>
#include <cstdlib>

namespace octet::testing {

uint64_t fresh_seed() {
  if (const char* pinned = std::getenv("OCTET_TEST_SEED")) return std::strtoull(pinned, nullptr, 0);
  static std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

bool small_tests_only() {
  const char* value = std::getenv("OCTET_TEST_SMALL");
  return value != nullptr && value[0] != '\0' && std::string(value) != "0";
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
      case DType::f32: std::memcpy(&out[i], &bytes[4 * i], 4); break;
      case DType::bf16: {
        uint16_t v;
        std::memcpy(&v, &bytes[2 * i], 2);
        out[i] = fp8::decode_bf16(v);
        break;
      }
      case DType::e4m3: out[i] = fp8::decode_e4m3(bytes[i]); break;
      case DType::e5m2: out[i] = fp8::decode_e5m2(bytes[i]); break;
      case DType::e8m0: out[i] = fp8::decode_e8m0(bytes[i]); break;
      default: OCTET_ERROR("to_floats: unsupported dtype ", dtype_name(t.dtype()));
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

}  // namespace octet::testing
