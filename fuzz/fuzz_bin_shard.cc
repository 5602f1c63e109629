// libFuzzer target: an llm.c token shard ("bin:" source) from arbitrary bytes. It either loads,
// and then every token is below the vocabulary it reports and batches read, or fails with a
// one-line octet::Error.
#include <cstdint>

#include "fuzz_token_source.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = octet::fuzz::input_file(data, size);
  octet::fuzz::expect_clean([&] {
    auto source = octet::train::make_token_source("bin:" + path, /*seed=*/size);
    octet::fuzz::exercise(*source);
  });
  return 0;
}
