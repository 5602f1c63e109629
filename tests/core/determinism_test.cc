#include "octet/core/determinism.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "octet/core/error.h"

namespace octet {
namespace {

using ::testing::HasSubstr;

constexpr const char* kEnv = "OCTET_DETERMINISTIC";

/// Starts every test with determinism off (env unset, API off) and restores the caller's state.
class Determinism : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const char* value = std::getenv(kEnv)) saved_env_ = value;
    unsetenv(kEnv);
    saved_api_ = deterministic();  // with the environment cleared, only the API speaks
    set_deterministic(false);
  }
  void TearDown() override {
    set_deterministic(saved_api_);
    if (saved_env_) {
      setenv(kEnv, saved_env_->c_str(), 1);
    } else {
      unsetenv(kEnv);
    }
  }

 private:
  std::optional<std::string> saved_env_;
  bool saved_api_ = false;
};

TEST_F(Determinism, OffByDefault) { EXPECT_FALSE(deterministic()); }

TEST_F(Determinism, TheSetterCounts) {
  set_deterministic(true);
  EXPECT_TRUE(deterministic());
  set_deterministic(false);
  EXPECT_FALSE(deterministic());
}

TEST_F(Determinism, TheEnvironmentCounts) {
  for (const char* on : {"1", "true", "yes", "2"}) {
    setenv(kEnv, on, 1);
    EXPECT_TRUE(deterministic()) << kEnv << "=" << on;
  }
  for (const char* off : {"", "0"}) {
    setenv(kEnv, off, 1);
    EXPECT_FALSE(deterministic()) << kEnv << "='" << off << "'";
  }
}

TEST_F(Determinism, NeitherSourceVetoesTheOther) {
  setenv(kEnv, "1", 1);
  set_deterministic(false);  // the API cannot switch off what the environment asked for
  EXPECT_TRUE(deterministic());
  setenv(kEnv, "0", 1);
  set_deterministic(true);  // nor can the environment switch off the API
  EXPECT_TRUE(deterministic());
}

TEST_F(Determinism, UnsupportedPathThrowsNamingTheRemedy) {
  EXPECT_NO_THROW(check_deterministic_supported("grouped_gemm_dprob", "use the tiled kernel"));
  for (int source = 0; source < 2; ++source) {
    SCOPED_TRACE(source == 0 ? "set_deterministic" : kEnv);
    if (source == 0) {
      set_deterministic(true);
    } else {
      set_deterministic(false);
      setenv(kEnv, "1", 1);
    }
    try {
      check_deterministic_supported("grouped_gemm_dprob", "disable scale_bias to use it");
      ADD_FAILURE() << "check_deterministic_supported did not throw";
    } catch (const Error& e) {
      EXPECT_THAT(e.message(), HasSubstr("grouped_gemm_dprob has no deterministic implementation"));
      EXPECT_THAT(e.message(), HasSubstr("OCTET_DETERMINISTIC or set_deterministic"));
      EXPECT_THAT(e.message(), HasSubstr("disable scale_bias to use it"));
    }
  }
}

}  // namespace
}  // namespace octet
