// libFuzzer target: load_safetensors on arbitrary bytes. A file either loads, and then every
// tensor reads back with the size its header promised, or fails with a one-line octet::Error.
#include <cstdint>

#include "fuzz_input.h"
#include "octet/train/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = octet::fuzz::input_file(data, size);
  octet::fuzz::expect_clean([&] {
    const octet::train::SafetensorsFile file = octet::train::load_safetensors(path);
    uint64_t bytes = 0;
    for (const std::string& name : file.names()) {
      const octet::Tensor t = file.get(name);
      octet::fuzz::require(t.shape() == file.shape(name) && t.dtype() == file.dtype(name),
                           "a tensor reads back with its header's shape and dtype");
      bytes += t.nbytes();
    }
    octet::fuzz::require(bytes <= size, "the tensors fit in the file");
  });
  return 0;
}
