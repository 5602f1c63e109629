// The test seeds themselves: fixed by the test's name unless OCTET_TEST_SEED varies them.
// Runs this binary again (one test, as a child process) to see what a fresh run draws.
#include "test_util.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <regex>
#include <string>

namespace octet::testing {
namespace {

TEST(TestSeeds, SuccessiveDrawsDiffer) {
  const uint64_t first = fresh_seed(), second = fresh_seed(), third = fresh_seed();
  EXPECT_NE(first, second);
  EXPECT_NE(second, third);
  EXPECT_NE(first, third);
}

/// The seed that TestSeeds.SuccessiveDrawsDiffer prints in a new process with `env` set.
std::string child_seed(const std::string& env) {
  // This binary's path, read here: in the child's shell /proc/self/exe is the shell.
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  // The child runs one test, so it must not inherit a sharded parent's shard, which may hold none.
  const std::string command = "env -u GTEST_TOTAL_SHARDS -u GTEST_SHARD_INDEX " + env + " '" +
                              self + "' --gtest_filter=TestSeeds.SuccessiveDrawsDiffer 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command.c_str(), "r"), &::pclose);
  if (!pipe) return "(popen failed)";
  std::string output;
  std::array<char, 4096> buffer;
  size_t got;
  while ((got = std::fread(buffer.data(), 1, buffer.size(), pipe.get())) > 0)
    output.append(buffer.data(), got);
  std::smatch match;
  const std::regex line(
      R"(\[   SEED   \] TestSeeds\.SuccessiveDrawsDiffer seed (\d+) \(([^)]*)\))");
  if (!std::regex_search(output, match, line)) return "(no seed line in: " + output + ")";
  return match[1].str() + " " + match[2].str();
}

TEST(TestSeeds, FixedByTheNameAndVariedByTheEnvironment) {
  const std::string plain = child_seed("env -u OCTET_TEST_SEED");
  EXPECT_THAT(plain, ::testing::EndsWith("from the test name; OCTET_TEST_SEED unset replays it"));
  EXPECT_EQ(child_seed("env -u OCTET_TEST_SEED"), plain) << "a second run draws the same";

  const std::string five = child_seed("OCTET_TEST_SEED=5");
  EXPECT_THAT(five, ::testing::EndsWith("OCTET_TEST_SEED=5 replays it"));
  EXPECT_NE(five.substr(0, five.find(' ')), plain.substr(0, plain.find(' ')));
  EXPECT_EQ(child_seed("OCTET_TEST_SEED=5"), five);

  // "random" draws a run seed and names it; that setting replays the run.
  const std::string random = child_seed("OCTET_TEST_SEED=random");
  const std::smatch setting = [&] {
    std::smatch m;
    std::regex_search(random, m, std::regex(R"(OCTET_TEST_SEED=(\d+) replays it)"));
    return m;
  }();
  ASSERT_FALSE(setting.empty()) << random;
  EXPECT_EQ(child_seed("OCTET_TEST_SEED=" + setting[1].str()), random);
}

}  // namespace
}  // namespace octet::testing
