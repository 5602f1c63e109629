// libFuzzer target: a "text:" source from arbitrary bytes. It either loads, and then its byte
// tokens are below 256 and batches read, or fails with a one-line octet::Error.
#include <cstdint>

#include "fuzz_token_source.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = octet::fuzz::input_file(data, size);
  octet::fuzz::expect_clean([&] {
    auto source = octet::train::make_token_source("text:" + path, /*seed=*/size);
    octet::fuzz::require(source->vocab_size() == octet::train::kByteVocab, "text is byte tokens");
    octet::fuzz::exercise(*source);
  });
  return 0;
}
