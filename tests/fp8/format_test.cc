// The scalar encoders of include/octet/fp8/format.h against CUDA's own host-side conversions, over
// every float bit pattern, plus hand-derived edge cases that hold with or without the toolkit.
#include "octet/fp8/format.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cfloat>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#if __has_include(<cuda_fp8.h>) && __has_include(<cuda_bf16.h>)
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#define OCTET_HAVE_CUDA_FORMAT_HEADERS 1
#else
#define OCTET_HAVE_CUDA_FORMAT_HEADERS 0
#endif

namespace octet::fp8 {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

#if OCTET_HAVE_CUDA_FORMAT_HEADERS
#define OCTET_REQUIRE_CUDA_HEADERS() (void)0
#else
#define OCTET_REQUIRE_CUDA_HEADERS() \
  GTEST_SKIP() << "cuda_fp8.h / cuda_bf16.h not found: nothing to compare against"
#endif

#if OCTET_HAVE_CUDA_FORMAT_HEADERS
uint32_t cuda_e4m3(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
uint32_t cuda_e5m2(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2); }
uint32_t cuda_bf16(float x) { return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(x)).x; }
uint32_t cuda_e8m0(float x) { return __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf); }

/// Runs ours(x) and theirs(x) for the float bit patterns [0, end) (in parallel) and fails with the
/// count of differences and the lowest differing pattern.
template <typename Ours, typename Theirs>
void expect_same_on_all_floats(uint64_t end, Ours ours, Theirs theirs) {
  uint64_t mismatches = 0;
  uint64_t first = UINT64_MAX;
#pragma omp parallel for schedule(static) reduction(+ : mismatches) reduction(min : first)
  for (int64_t i = 0; i < static_cast<int64_t>(end); ++i) {
    const float x = bits_float(static_cast<uint32_t>(i));
    if (static_cast<uint32_t>(ours(x)) != theirs(x)) {
      ++mismatches;
      first = std::min(first, static_cast<uint64_t>(i));
    }
  }
  if (mismatches == 0) return;
  const float x = bits_float(static_cast<uint32_t>(first));
  ADD_FAILURE() << mismatches << " of " << end << " inputs differ; first: bits 0x" << std::hex
                << first << " (" << std::hexfloat << x << "): octet 0x"
                << static_cast<uint32_t>(ours(x)) << ", CUDA 0x" << theirs(x);
}

constexpr uint64_t kAllFloats = uint64_t{1} << 32;
constexpr uint64_t kNonNegativeFloats = uint64_t{1} << 31;  // sign bit clear, NaNs included

TEST(FormatExhaustive, E4M3MatchesCuda) {
  expect_same_on_all_floats(kAllFloats, encode_e4m3, cuda_e4m3);
}

TEST(FormatExhaustive, E5M2MatchesCuda) {
  expect_same_on_all_floats(kAllFloats, encode_e5m2, cuda_e5m2);
}

TEST(FormatExhaustive, BF16MatchesCuda) {
  expect_same_on_all_floats(kAllFloats, encode_bf16, cuda_bf16);
}

// encode_e8m0_round_up is documented for non-negative inputs (block amax / fp8_max).
TEST(FormatExhaustive, E8M0RoundUpMatchesCuda) {
  expect_same_on_all_floats(kNonNegativeFloats, encode_e8m0_round_up, cuda_e8m0);
}

/// Both NaN, or the same bits (so -0 and +0 differ).
::testing::AssertionResult same_float(float expected, float actual) {
  if (std::isnan(expected) && std::isnan(actual)) return ::testing::AssertionSuccess();
  if (float_bits(expected) == float_bits(actual)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected " << std::hexfloat << expected << ", got "
                                       << actual;
}

float half_raw_to_float(__half_raw h) { return __half2float(__half(h)); }

TEST(FormatDecode, AllFp8CodesMatchCuda) {
  for (int v = 0; v < 256; ++v) {
    SCOPED_TRACE("code 0x" + std::to_string(v));
    const auto code = static_cast<__nv_fp8_storage_t>(v);
    EXPECT_TRUE(same_float(half_raw_to_float(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3)),
                           decode_e4m3(static_cast<uint8_t>(v))));
    EXPECT_TRUE(same_float(half_raw_to_float(__nv_cvt_fp8_to_halfraw(code, __NV_E5M2)),
                           decode_e5m2(static_cast<uint8_t>(v))));
    const __nv_bfloat16_raw e8m0_as_bf16 = __nv_cvt_e8m0_to_bf16raw(code);
    EXPECT_TRUE(same_float(__bfloat162float(__nv_bfloat16(e8m0_as_bf16)),
                           decode_e8m0(static_cast<uint8_t>(v))));
  }
}

#else
TEST(FormatExhaustive, E4M3MatchesCuda) { OCTET_REQUIRE_CUDA_HEADERS(); }
TEST(FormatExhaustive, E5M2MatchesCuda) { OCTET_REQUIRE_CUDA_HEADERS(); }
TEST(FormatExhaustive, BF16MatchesCuda) { OCTET_REQUIRE_CUDA_HEADERS(); }
TEST(FormatExhaustive, E8M0RoundUpMatchesCuda) { OCTET_REQUIRE_CUDA_HEADERS(); }
TEST(FormatDecode, AllFp8CodesMatchCuda) { OCTET_REQUIRE_CUDA_HEADERS(); }
#endif

// Every finite FP8 code decodes to a value that encodes back to the same code (and -0 stays -0).
TEST(FormatDecode, FiniteCodesRoundTrip) {
  for (int v = 0; v < 256; ++v) {
    SCOPED_TRACE("code 0x" + std::to_string(v));
    const auto code = static_cast<uint8_t>(v);
    if ((v & 0x7F) != 0x7F) EXPECT_EQ(encode_e4m3(decode_e4m3(code)), code);
    if ((v & 0x7C) != 0x7C) EXPECT_EQ(encode_e5m2(decode_e5m2(code)), code);
  }
}
/// One hand-derived row: the input and its expected encodings.
struct EdgeCase {
  const char* what;
  float x;
  uint8_t e4m3;
  uint8_t e5m2;
  uint16_t bf16;
};

// Expected codes derived by hand from the formats (and confirmed against CUDA above).
constexpr EdgeCase kEdgeCases[] = {
    {"e4m3 max", 448.0f, 0x7E, 0x5F, 0x43E0},
    {"e4m3 max + half ulp: tie to even stays at max", 464.0f, 0x7E, 0x5F, 0x43E8},
    {"above the e4m3 tie: saturates", 465.0f, 0x7E, 0x5F, 0x43E8},
    {"-e4m3 max", -448.0f, 0xFE, 0xDF, 0xC3E0},
    {"e5m2 max", 57344.0f, 0x7E, 0x7B, 0x4760},
    {"e5m2 max + half ulp: saturates", 61440.0f, 0x7E, 0x7B, 0x4770},
    {"above any finite fp8", 1e30f, 0x7E, 0x7B, 0x714A},
    {"+inf saturates", kInf, 0x7E, 0x7B, 0x7F80},
    {"-inf saturates", -kInf, 0xFE, 0xFB, 0xFF80},
    {"NaN", kNaN, 0x7F, 0x7F, 0x7FFF},
    {"-NaN: canonical positive", -kNaN, 0x7F, 0x7F, 0x7FFF},
    {"-0 keeps its sign", -0.0f, 0x80, 0x80, 0x8000},
    {"+0", 0.0f, 0x00, 0x00, 0x0000},
    {"e4m3 smallest subnormal 2^-9", 0x1p-9f, 0x01, 0x18, 0x3B00},
    {"2^-10: tie between 0 and 2^-9 goes to even 0", 0x1p-10f, 0x00, 0x14, 0x3A80},
    {"just above 2^-10 rounds up", 0x1.000002p-10f, 0x01, 0x14, 0x3A80},
    {"3*2^-10: tie between codes 1 and 2 goes to 2", 0x1.8p-9f, 0x02, 0x1A, 0x3B40},
    {"e5m2 smallest subnormal 2^-16", 0x1p-16f, 0x00, 0x01, 0x3780},
    {"2^-17: e5m2 tie to 0", 0x1p-17f, 0x00, 0x00, 0x3700},
    {"just above 2^-17", 0x1.000002p-17f, 0x00, 0x01, 0x3700},
    {"1 + 1/16: e4m3 tie down to 1", 1.0625f, 0x38, 0x3C, 0x3F88},
    {"1 + 3/16: e4m3 tie up to 1.25", 1.1875f, 0x3A, 0x3D, 0x3F98},
    {"1 + 1/8: e5m2 tie down to 1", 1.125f, 0x39, 0x3C, 0x3F90},
    {"1 + 3/8: e5m2 tie up to 1.5", 1.375f, 0x3B, 0x3E, 0x3FB0},
    {"1 + 2^-8: bf16 tie down", 1.00390625f, 0x38, 0x3C, 0x3F80},
    {"1 + 3*2^-8: bf16 tie up", 1.01171875f, 0x38, 0x3C, 0x3F82},
    {"FLT_MAX: bf16 rounds to inf", FLT_MAX, 0x7E, 0x7B, 0x7F80},
};

TEST(FormatEdgeCases, HandDerivedCodes) {
  for (const EdgeCase& c : kEdgeCases) {
    SCOPED_TRACE(c.what);
    EXPECT_EQ(encode_e4m3(c.x), c.e4m3);
    EXPECT_EQ(encode_e5m2(c.x), c.e5m2);
    EXPECT_EQ(encode_bf16(c.x), c.bf16);
    EXPECT_EQ(encode_fp8(c.x, DType::e4m3), c.e4m3);
    EXPECT_EQ(encode_fp8(c.x, DType::e5m2), c.e5m2);
#if OCTET_HAVE_CUDA_FORMAT_HEADERS
    EXPECT_EQ(cuda_e4m3(c.x), c.e4m3);
    EXPECT_EQ(cuda_e5m2(c.x), c.e5m2);
    EXPECT_EQ(cuda_bf16(c.x), c.bf16);
#endif
  }
}

TEST(FormatEdgeCases, E8M0RoundsUpToAPowerOfTwo) {
  struct Case {
    float x;
    uint8_t e8m0;
  };
  const Case cases[] = {
      {0.0f, 0},             // 2^-127 is the smallest E8M0 value
      {0x1p-149f, 0},        // the smallest float subnormal rounds up to 2^-127
      {0x1p-127f, 0},        // exact
      {0x1.000004p-127f, 1}, // just above 2^-127 (a float subnormal) -> 2^-126
      {0x1p-126f, 1},        // exact
      {1.0f, 127},           // exact
      {1.5f, 128},           // -> 2
      {3.0f, 129},           // -> 4
      {0x1p127f, 254},       // the largest E8M0 value
      {0x1.000002p126f, 254},
      {FLT_MAX, 254},        // saturates
      {kInf, 254},           // saturates
      {kNaN, kE8M0NaN},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << std::hexfloat << c.x);
    EXPECT_EQ(encode_e8m0_round_up(c.x), c.e8m0);
#if OCTET_HAVE_CUDA_FORMAT_HEADERS
    EXPECT_EQ(cuda_e8m0(c.x), c.e8m0);
#endif
  }
}

TEST(FormatEdgeCases, DecodeKnownValues) {
  EXPECT_EQ(decode_e4m3(0x7E), kE4M3Max);
  EXPECT_EQ(decode_e4m3(0xFE), -kE4M3Max);
  EXPECT_EQ(decode_e4m3(0x01), 0x1p-9f);
  EXPECT_EQ(decode_e4m3(0x38), 1.0f);
  EXPECT_TRUE(std::isnan(decode_e4m3(0x7F)));
  EXPECT_TRUE(std::isnan(decode_e4m3(0xFF)));
  EXPECT_EQ(float_bits(decode_e4m3(0x80)), 0x80000000u);  // -0
  EXPECT_EQ(decode_e5m2(0x7B), kE5M2Max);
  EXPECT_EQ(decode_e5m2(0x01), 0x1p-16f);
  EXPECT_EQ(decode_e5m2(0x7C), kInf);
  EXPECT_EQ(decode_e5m2(0xFC), -kInf);
  EXPECT_TRUE(std::isnan(decode_e5m2(0x7D)));
  EXPECT_EQ(decode_bf16(0x3F80), 1.0f);
  EXPECT_EQ(decode_e8m0(127), 1.0f);
  EXPECT_EQ(decode_e8m0(0), 0x1p-127f);
  EXPECT_EQ(decode_e8m0(254), 0x1p127f);
  EXPECT_TRUE(std::isnan(decode_e8m0(kE8M0NaN)));
  EXPECT_EQ(fp8_max(DType::e4m3), 448.0f);
  EXPECT_EQ(fp8_max(DType::e5m2), 57344.0f);
}

}  // namespace
}  // namespace octet::fp8
