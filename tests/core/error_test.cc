#include "octet/core/error.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <stdexcept>

namespace octet {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(Error, CarriesFileLineAndMessage) {
  int line = 0;
  try {
    line = __LINE__ + 1;
    OCTET_ERROR("expected ", 3, " rows, got ", 4.5);
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "expected 3 rows, got 4.5");
    EXPECT_THAT(e.what(), HasSubstr("error_test.cc:" + std::to_string(line) + ": "));
    EXPECT_THAT(e.what(), EndsWith(": expected 3 rows, got 4.5"));
    return;
  }
  FAIL() << "OCTET_ERROR did not throw";
}

TEST(Error, IsAStdRuntimeError) {
  EXPECT_THROW(OCTET_ERROR("boom"), std::runtime_error);
  EXPECT_THROW(OCTET_ERROR("boom"), Error);
}

TEST(Error, CheckPassesSilently) { EXPECT_NO_THROW(OCTET_CHECK(1 + 1 == 2, "never shown")); }

TEST(Error, CheckShowsItsMessageAndNamesTheConditionInWhat) {
  const int rows = 3, expected = 4;
  try {
    OCTET_CHECK(rows == expected, "expected ", expected, " rows, got ", rows);
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "expected 4 rows, got 3");
    EXPECT_THAT(e.what(), HasSubstr(": check failed: rows == expected: expected 4 rows, got 3"));
    return;
  }
  FAIL() << "OCTET_CHECK did not throw";
}

TEST(Error, CheckWithoutAMessage) {
  try {
    OCTET_CHECK(false);
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), StartsWith("check failed: false"));
    return;
  }
  FAIL() << "OCTET_CHECK did not throw";
}

TEST(Error, CheckEvaluatesItsConditionOnce) {
  int calls = 0;
  auto once = [&] { return ++calls == 1; };
  EXPECT_NO_THROW(OCTET_CHECK(once(), "evaluated twice"));
  EXPECT_EQ(calls, 1);
}

TEST(Error, MessageArgumentsAreOnlyBuiltOnFailure) {
  int built = 0;
  auto expensive = [&] {
    ++built;
    return "detail";
  };
  OCTET_CHECK(true, expensive());
  EXPECT_EQ(built, 0);
}

}  // namespace
}  // namespace octet
