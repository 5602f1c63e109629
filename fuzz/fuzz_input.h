// Shared by the libFuzzer targets: the input as a file the readers can open, and the contract
// every reader keeps on hostile bytes.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "octet/core/error.h"

namespace octet::fuzz {

/// The readers take paths, so each input is written to one in-memory file (memfd: no disk
/// traffic), rewritten for every input; returns its path.
inline const std::string& input_file(const uint8_t* data, size_t size) {
  static const int fd = ::memfd_create("octet-fuzz-input", 0);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (fd < 0 || ::ftruncate(fd, 0) != 0) std::abort();
  for (size_t done = 0; done < size;) {
    const ssize_t wrote = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (wrote <= 0) std::abort();
    done += static_cast<size_t>(wrote);
  }
  return path;
}

/// Fails the run (libFuzzer saves the input) when `ok` is false.
inline void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "octet fuzz: broken promise: %s\n", what);
  std::abort();
}

/// Runs `read`: it may succeed or throw octet::Error with a one-line message. Anything else (a
/// crash, a sanitizer report, another exception such as std::bad_alloc) is a bug.
template <typename Read>
void expect_clean(Read&& read) {
  try {
    read();
  } catch (const Error& e) {
    const std::string message = e.what();
    require(!message.empty() && message.find('\n') == std::string::npos,
            "errors are one non-empty line");
  }
}

}  // namespace octet::fuzz
