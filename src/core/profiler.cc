#include "octet/core/profiler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>

#if OCTET_WITH_CUDA
#include <cuda_profiler_api.h>

#include "octet/core/cuda_context.h"
#endif

namespace octet::profiler {
namespace {

using Clock = std::chrono::steady_clock;

/// One timed call, resolved by collect().
struct Record {
  std::string op;
  Device device;
  Clock::time_point host_start, host_stop;  ///< the call on the host, every op
#if OCTET_WITH_CUDA
  cudaEvent_t start = nullptr, stop = nullptr;  ///< GPU ops
#endif
};

struct State {
  std::mutex mutex;
  std::atomic<bool> enabled = false;  ///< read by every op call, unlocked
  std::vector<Record> records;
#if OCTET_WITH_CUDA
  std::map<int, std::vector<cudaEvent_t>> free_events;  ///< per device index, for reuse

  /// An event on the current device (the op's, under its guard).
  cudaEvent_t take_event(int device_index) {
    std::vector<cudaEvent_t>& pool = free_events[device_index];
    if (!pool.empty()) {
      cudaEvent_t e = pool.back();
      pool.pop_back();
      return e;
    }
    cudaEvent_t e;
    OCTET_CHECK_CUDA(cudaEventCreate(&e));
    return e;
  }
#endif
};

State& state() {
  static State* s = new State;  // never destroyed: events outlive static destructors
  return *s;
}

/// Nesting depth of op calls on this thread: only depth 0 is timed.
thread_local int depth = 0;

}  // namespace

void set_enabled(bool on) {
  state().enabled = on;
#if OCTET_WITH_CUDA
  // The same window is the CUDA profiler's capture range, so `ncu --profile-from-start off` sees
  // exactly the profiled steps. Without a GPU (or a profiler) these calls do nothing useful; their
  // status is dropped.
  if ((on ? cudaProfilerStart() : cudaProfilerStop()) != cudaSuccess) (void)cudaGetLastError();
#endif
}

bool enabled() { return state().enabled; }

OpScope::OpScope(const Device& device, const char* op) : device_(device) {
  if (depth++ > 0 || !enabled()) return;
  active_ = true;
  State& s = state();
  std::lock_guard lock(s.mutex);
  Record r;
  r.op = op;
  r.device = device;
  if (!device.is_cpu()) {
#if OCTET_WITH_CUDA
    r.start = s.take_event(device.index);
    r.stop = s.take_event(device.index);
    OCTET_CHECK_CUDA(cudaEventRecord(r.start, cuda::stream(device)));
#endif
  }
  pending_ = static_cast<int64_t>(s.records.size());
  r.host_start = Clock::now();
  s.records.push_back(std::move(r));
}

OpScope::~OpScope() {
  --depth;
  if (!active_) return;
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (pending_ >= static_cast<int64_t>(s.records.size())) return;  // collected meanwhile
  Record& r = s.records[static_cast<size_t>(pending_)];
  r.host_stop = Clock::now();
  if (!device_.is_cpu()) {
#if OCTET_WITH_CUDA
    // A destructor must not throw: an unrecorded stop event reads as 0 ms in collect().
    if (cudaEventRecord(r.stop, cuda::stream(device_)) != cudaSuccess) (void)cudaGetLastError();
#endif
  }
}

std::vector<OpTime> collect() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  std::map<std::string, OpTime> totals;
  for (Record& r : s.records) {
    OpTime& t = totals[r.op];
    t.op = r.op;
    ++t.calls;
    const double host_ms =
        std::chrono::duration<double, std::milli>(r.host_stop - r.host_start).count();
    t.host_ms += host_ms;
    if (r.device.is_cpu()) {
      t.ms += host_ms;
      continue;
    }
#if OCTET_WITH_CUDA
    float ms = 0;
    OCTET_CHECK_CUDA(cudaEventSynchronize(r.stop));
    if (cudaEventElapsedTime(&ms, r.start, r.stop) != cudaSuccess) (void)cudaGetLastError();
    t.ms += ms;
    s.free_events[r.device.index].push_back(r.start);
    s.free_events[r.device.index].push_back(r.stop);
#endif
  }
  s.records.clear();
  std::vector<OpTime> out;
  for (auto& [name, t] : totals) out.push_back(std::move(t));
  std::sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.ms > b.ms; });
  return out;
}

}  // namespace octet::profiler
