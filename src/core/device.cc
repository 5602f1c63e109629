#include "octet/core/device.h"

#include <charconv>

#include "octet/core/error.h"

#if OCTET_WITH_CUDA
#include "octet/core/cuda_context.h"
#endif

namespace octet {

Device Device::parse(std::string_view text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  constexpr std::string_view prefix = "cuda:";
  if (text.substr(0, prefix.size()) == prefix) {
    std::string_view digits = text.substr(prefix.size());
    int index = -1;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (ec == std::errc() && end == digits.data() + digits.size() && index >= 0)
      return cuda(index);
  }
  OCTET_ERROR("unknown device '", text, "'; expected cpu, cuda or cuda:N");
}

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

bool built_with_cuda() { return OCTET_WITH_CUDA != 0; }

int cuda_device_count() {
#if OCTET_WITH_CUDA
  // Read once: the visible GPUs are fixed when the CUDA runtime starts, and every op's stream
  // lookup and allocation checks its device against this count.
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // no driver or no GPU: clear the sticky-free error and report none
      return 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

void check_device_available(const Device& device) {
  if (device.is_cpu()) return;
  OCTET_CHECK(built_with_cuda(), "device ", device, " requested, but octet was built without CUDA");
  int count = cuda_device_count();
  OCTET_CHECK(device.index >= 0 && device.index < count, "device ", device, " requested, but ", count,
              " CUDA GPU(s) are visible");
}

DeviceGuard::DeviceGuard(const Device& device) {
#if OCTET_WITH_CUDA
  if (!device.is_cuda()) return;
  int current = 0;
  OCTET_CHECK_CUDA(cudaGetDevice(&current));
  if (current == device.index) return;  // nothing to switch, nothing to restore
  OCTET_CHECK_CUDA(cudaSetDevice(device.index));
  previous_ = current;
#else
  OCTET_CHECK(device.is_cpu(), "device ", device, " requested, but octet was built without CUDA");
#endif
}

DeviceGuard::~DeviceGuard() {
#if OCTET_WITH_CUDA
  if (previous_ >= 0) cudaSetDevice(previous_);
#endif
}

}  // namespace octet
