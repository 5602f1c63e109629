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

std::vector<Device> Device::parse_list(std::string_view text) {
  std::vector<Device> devices;
  size_t begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    const std::string_view item = text.substr(
        begin, comma == std::string_view::npos ? std::string_view::npos : comma - begin);
    const bool bare_index = !item.empty() && item.find_first_not_of("0123456789") == item.npos;
    if (bare_index && !devices.empty() && devices.back().is_cuda()) {
      devices.push_back(parse("cuda:" + std::string(item)));
    } else {
      OCTET_CHECK(!item.empty(), "empty entry in the device list '", text, "'");
      try {
        devices.push_back(parse(item));
      } catch (const Error&) {
        OCTET_ERROR("unknown device '", item, "' in the device list '", text,
                    "'; expected cpu, cuda, cuda:N, or a list such as cuda:0,1");
      }
    }
    OCTET_CHECK(devices.back().kind == devices.front().kind, "the device list '", text,
                "' mixes the CPU and GPUs; a split model runs on GPUs only (or on the CPU only)");
    if (comma == std::string_view::npos) return devices;
    begin = comma + 1;
  }
}

std::string device_list_str(const std::vector<Device>& devices) {
  std::string text;
  for (const Device& d : devices) text += (text.empty() ? "" : ",") + d.str();
  return text;
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
