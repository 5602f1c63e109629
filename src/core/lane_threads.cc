#include "core/lane_threads.h"

#include <unistd.h>

#include <atomic>
#include <exception>
#include <mutex>
#include <semaphore>
#include <system_error>
#include <thread>

#include "octet/core/error.h"

namespace octet {
namespace {

std::atomic<long long> g_run_inline{0};

/// One kept thread's mailbox: the call posts a job and its lane, then releases `start`.
struct Worker {
  std::binary_semaphore start{0};
  const std::function<void(int)>* job = nullptr;
  int lane = 0;
  std::exception_ptr error;
};

/// The threads of one process, made on first use and never destroyed: a static destructor
/// would run while they wait for their next job.
struct LaneThreads {
  const pid_t owner = getpid();
  std::atomic<bool> busy{false};  ///< set by the run_on_lanes call that uses the threads
  std::counting_semaphore<kMaxLanes> done{0};
  Worker workers[kMaxLanes];  ///< workers[l] runs lane l; lane 0 is the caller's
  int started = 1;            ///< workers[1 .. started - 1] have their thread

  /// Gives lanes 1 .. lanes - 1 a thread; false if the system refused one.
  bool ensure(int lanes) {
    try {
      for (; started < lanes; ++started) {
        Worker* worker = &workers[started];
        std::thread([this, worker] {
          for (;;) {
            worker->start.acquire();
            try {
              (*worker->job)(worker->lane);
            } catch (...) {
              worker->error = std::current_exception();
            }
            done.release();
          }
        }).detach();
      }
    } catch (const std::system_error&) {
      return false;
    }
    return true;
  }
};

/// This process's threads. A child forked after they were made has none of them (fork copies
/// only the calling thread), so it makes its own.
LaneThreads& lane_threads() {
  static std::mutex mutex;
  static LaneThreads* threads = nullptr;
  std::lock_guard lock(mutex);
  if (threads == nullptr || threads->owner != getpid()) threads = new LaneThreads;
  return *threads;
}

/// The lanes one after another; the same contract as run_on_lanes.
void run_inline(int lanes, const std::function<void(int)>& job) {
  g_run_inline.fetch_add(1, std::memory_order_relaxed);
  std::exception_ptr first;
  for (int lane = 0; lane < lanes; ++lane) {
    try {
      job(lane);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace

void run_on_lanes(int lanes, const std::function<void(int lane)>& job) {
  OCTET_CHECK(lanes >= 1 && lanes <= kMaxLanes, "run_on_lanes: lanes must be 1 to ", kMaxLanes,
              ", got ", lanes);
  if (lanes == 1) {
    job(0);
    return;
  }
  LaneThreads& threads = lane_threads();
  bool idle = false;
  if (!threads.busy.compare_exchange_strong(idle, true)) {
    run_inline(lanes, job);  // a call from a job, or from another thread meanwhile
    return;
  }
  struct Release {
    std::atomic<bool>& busy;
    ~Release() { busy.store(false); }
  } release{threads.busy};
  if (!threads.ensure(lanes)) {
    run_inline(lanes, job);
    return;
  }
  for (int lane = 1; lane < lanes; ++lane) {
    Worker& worker = threads.workers[lane];
    worker.job = &job;
    worker.lane = lane;
    worker.error = nullptr;
    worker.start.release();
  }
  std::exception_ptr first;
  try {
    job(0);
  } catch (...) {
    first = std::current_exception();
  }
  for (int lane = 1; lane < lanes; ++lane) threads.done.acquire();
  for (int lane = 1; lane < lanes; ++lane) {
    if (!first) first = threads.workers[lane].error;
    threads.workers[lane].error = nullptr;
  }
  if (first) std::rethrow_exception(first);
}

long long lanes_run_inline() { return g_run_inline.load(); }

}  // namespace octet
