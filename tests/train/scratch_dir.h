// Helpers of the train tests that touch files: a scratch folder per test
// (tests/train/scratch_dir.cc) and reading a file back whole.
#pragma once

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace octet::testing {

/// A fresh, empty folder named after the running test, under a per-process folder in the system
/// temp directory that is removed when the process exits.
std::filesystem::path scratch_dir();

/// The bytes of the file at `path` ("" when it cannot be read).
inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace octet::testing
