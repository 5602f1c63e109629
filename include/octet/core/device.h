// Where a tensor lives: the CPU or one CUDA GPU. There is no "current device" in octet.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

namespace octet {

struct Device {
  enum class Kind : uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;  ///< GPU ordinal for cuda; 0 for cpu

  static constexpr Device cpu() { return {Kind::cpu, 0}; }
  static constexpr Device cuda(int index) { return {Kind::cuda, index}; }
  /// Parses "cpu", "cuda" (= cuda:0) or "cuda:N"; throws octet::Error otherwise.
  static Device parse(std::string_view text);
  /// Parses a comma-separated list of one kind: "cuda:0,1,3" (a bare index after a GPU names
  /// another GPU), "cuda:0,cuda:2", "cpu,cpu", or one device. A device may repeat (a split on one
  /// GPU). Throws octet::Error naming the bad entry otherwise.
  static std::vector<Device> parse_list(std::string_view text);

  bool is_cpu() const { return kind == Kind::cpu; }
  bool is_cuda() const { return kind == Kind::cuda; }
  /// "cpu" or "cuda:N".
  std::string str() const;
  friend bool operator==(const Device&, const Device&) = default;
};

inline std::ostream& operator<<(std::ostream& out, const Device& d) { return out << d.str(); }

/// True when octet was compiled with the CUDA backend.
bool built_with_cuda();
/// Number of visible CUDA GPUs; 0 without CUDA or without a GPU (never throws).
int cuda_device_count();
/// Throws octet::Error unless `device` is the CPU or a visible GPU.
void check_device_available(const Device& device);
/// "cuda:0,cuda:1"; "cpu".
std::string device_list_str(const std::vector<Device>& devices);

/// RAII: makes `device` the CUDA runtime's device for this scope and restores the previous one,
/// also when the scope is left by an exception. A no-op for the CPU. Every CUDA entry point
/// opens one for its tensors' device, so no op depends on what the caller had selected.
class DeviceGuard {
 public:
  explicit DeviceGuard(const Device& device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;  ///< -1: nothing to restore
};

}  // namespace octet
