#include "octet/core/determinism.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

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

std::string read_source_file(const std::filesystem::path& relative) {
  std::ifstream in(std::filesystem::path(OCTET_SOURCE_DIR) / relative);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

/// Every public op is accounted for in docs/DETERMINISM.md, and every op there is deterministic
/// (an op that adds a non-deterministic path comes with a refusal test and a change here).
TEST(DeterminismDoc, ListsEveryPublicOp) {
  const std::string doc = read_source_file("docs/DETERMINISM.md");
  ASSERT_FALSE(doc.empty()) << "cannot read " << OCTET_SOURCE_DIR << "/docs/DETERMINISM.md";
  // Public functions: declarations at namespace scope (column 0) of the ops headers.
  const std::regex declaration(R"(^(?!struct|class|enum|using|namespace|template|static|return)[A-Za-z_][\w:<>, ]*[ *&]+([a-z_0-9]+)\()");
  std::set<std::string> functions;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::filesystem::path(OCTET_SOURCE_DIR) / "include/octet/ops")) {
    std::istringstream header(read_source_file(entry.path()));
    for (std::string line; std::getline(header, line);) {
      std::smatch m;
      if (std::regex_search(line, m, declaration)) functions.insert(m[1]);
    }
  }
  EXPECT_GT(functions.size(), 40u) << "the header scan found too few functions to be right";
  for (const std::string& f : functions)
    EXPECT_NE(doc.find("`" + f + "`"), std::string::npos)
        << "ops function " << f << " is not named in docs/DETERMINISM.md (its paths and whether "
        << "each is deterministic, or the list of functions that launch no work)";
  // The table of ops: its fourth column says whether the op is deterministic.
  std::istringstream table(doc.substr(doc.find("| op family |")));
  int rows = 0;
  for (std::string line; std::getline(table, line) && line.rfind("|", 0) == 0;) {
    std::vector<std::string> cells;
    std::istringstream row(line);
    for (std::string cell; std::getline(row, cell, '|');) cells.push_back(cell);
    if (cells.size() < 5 || cells[1].find("op family") != std::string::npos ||
        cells[1].find("---") != std::string::npos) {
      continue;
    }
    ++rows;
    EXPECT_EQ(cells[4], " yes ") << line;
  }
  EXPECT_GE(rows, 15);
}

}  // namespace
}  // namespace octet
