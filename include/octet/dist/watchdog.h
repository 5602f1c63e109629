// A deadline on every collective: a rank that died or hangs leaves the others waiting in a
// collective forever unless something outside the collective notices. The watchdog is a thread
// that a communicator arms around each collective; when one passes its deadline it reports the
// collective, the rank and the deadline, and ends the process (the launcher, mpirun or torchrun,
// then ends the other ranks).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace octet::dist {

/// The exit status of a process whose collective passed its deadline: sysexits.h's EX_TEMPFAIL
/// (a peer failed; the run may be resumed), distinct from `timeout`'s 124.
inline constexpr int kCollectiveTimeoutExit = 75;
/// The default deadline of one collective. A collective also waits for the slowest rank's work
/// before it (rank 0 writing a checkpoint, evaluating): ten minutes, NCCL's watchdog default in
/// PyTorch, covers a GPT-2 1.5B checkpoint on a slow disk.
inline constexpr int kDefaultCollectiveTimeoutSeconds = 600;
/// The variable that sets the deadline in seconds (e.g. 30 for a test).
inline constexpr const char* kCollectiveTimeoutVariable = "OCTET_COLLECTIVE_TIMEOUT_S";

/// The deadline from OCTET_COLLECTIVE_TIMEOUT_S (seconds, > 0), else the default. Throws on a
/// value that is not a positive number.
std::chrono::milliseconds collective_deadline();

class CollectiveWatchdog {
 public:
  /// Called on the watchdog's thread with the report when a collective passes its deadline.
  using Expired = std::function<void(const std::string& report)>;

  /// `who` names this process in the report ("rank 1 of 2 (mpi)").
  CollectiveWatchdog(std::chrono::milliseconds deadline, std::string who, Expired expired);
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  /// Arms the deadline for the collective `name` until the Scope ends.
  class Scope {
   public:
    Scope(CollectiveWatchdog& watchdog, const char* name);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    CollectiveWatchdog& watchdog_;
  };

 private:
  void run();

  const std::chrono::milliseconds deadline_;
  const std::string who_;
  const Expired expired_;
  std::mutex mutex_;
  std::condition_variable changed_;
  const char* armed_ = nullptr;  ///< the collective in flight, null when none
  std::chrono::steady_clock::time_point since_;
  bool stopping_ = false;
  std::thread thread_;  ///< last: starts after the members it reads
};

/// The default Expired: the report on stderr, then the process ends with kCollectiveTimeoutExit
/// (no destructors: the main thread is still blocked inside the collective).
[[noreturn]] void exit_on_expired_collective(const std::string& report);

}  // namespace octet::dist
