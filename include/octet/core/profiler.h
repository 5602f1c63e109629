// Per-op device time, for finding where a training step goes (`octet bench train --profile`).
//
// While enabled, every op entry point (ops::dispatch) is timed on its device: CUDA events on
// octet's stream for GPU ops, the host clock for CPU ops. Only the outermost op of a nested call
// is timed, so the totals add up without double counting. Disabled, it costs one branch per op.
// The host clock also times each GPU op's call (checks, planning, launches): where that is close
// to its device time, the GPU waited for the host, and the op is host-bound.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "octet/core/device.h"

namespace octet::profiler {

/// Total time and calls of one op name since the last collect().
struct OpTime {
  std::string op;
  int64_t calls = 0;
  double ms = 0;       ///< on the op's device
  double host_ms = 0;  ///< in the calls on the host (the same as ms for CPU ops)
};

/// Turns op timing on or off; the enabled window is also the CUDA profiler's capture range
/// (cudaProfilerStart/Stop), for `ncu --profile-from-start off`.
void set_enabled(bool on);
bool enabled();

/// Waits for the timed work and returns the per-op totals since the last call, largest first;
/// clears them.
std::vector<OpTime> collect();

/// Times one op call on `device` when profiling is enabled (constructed after the device guard).
class OpScope {
 public:
  OpScope(const Device& device, const char* op);
  ~OpScope();
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  bool active_ = false;
  Device device_;
  int64_t pending_ = -1;  ///< index of this call's record
};

}  // namespace octet::profiler
