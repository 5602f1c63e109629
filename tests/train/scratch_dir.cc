// A scratch folder per test for the train tests: under one per-process folder in the system temp
// directory, removed when the process exits.
#include "train/scratch_dir.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>

#include "octet/core/error.h"

namespace octet::testing {

namespace {
struct ProcessRoot {
  std::filesystem::path path;
  ProcessRoot() {
    std::string pattern = (std::filesystem::temp_directory_path() / "octet-train-XXXXXX").string();
    OCTET_CHECK(::mkdtemp(pattern.data()) != nullptr, "mkdtemp failed for ", pattern);
    path = pattern;
  }
  ~ProcessRoot() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};
}  // namespace

std::filesystem::path scratch_dir() {
  static ProcessRoot root;
  static int counter = 0;
  std::string name = "scratch";
  if (const auto* info = ::testing::UnitTest::GetInstance()->current_test_info())
    name = std::string(info->test_suite_name()) + "." + info->name();
  for (char& c : name)
    if (c == '/') c = '_';  // parameterized test names hold slashes
  const std::filesystem::path dir = root.path / (name + "." + std::to_string(counter++));
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace octet::testing
