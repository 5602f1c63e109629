// The collective watchdog (the header has the why).
#include "octet/dist/watchdog.h"

#include <cstdio>
#include <cstdlib>

#include "octet/core/error.h"

namespace octet::dist {

std::chrono::milliseconds collective_deadline() {
  const char* text = std::getenv(kCollectiveTimeoutVariable);
  if (text == nullptr || *text == '\0')
    return std::chrono::seconds(kDefaultCollectiveTimeoutSeconds);
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  OCTET_CHECK(end != text && *end == '\0' && seconds > 0 && seconds < 1e9,
              kCollectiveTimeoutVariable, " must be a positive number of seconds, got '", text,
              "'");
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

CollectiveWatchdog::CollectiveWatchdog(std::chrono::milliseconds deadline, std::string who,
                                       Expired expired)
    : deadline_(deadline),
      who_(std::move(who)),
      expired_(std::move(expired)),
      thread_([this] { run(); }) {}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

CollectiveWatchdog::Scope::Scope(CollectiveWatchdog& watchdog, const char* name)
    : watchdog_(watchdog) {
  {
    std::lock_guard lock(watchdog_.mutex_);
    watchdog_.armed_ = name;
    watchdog_.since_ = std::chrono::steady_clock::now();
  }
  watchdog_.changed_.notify_all();
}

CollectiveWatchdog::Scope::~Scope() {
  {
    std::lock_guard lock(watchdog_.mutex_);
    watchdog_.armed_ = nullptr;
  }
  watchdog_.changed_.notify_all();
}

void CollectiveWatchdog::run() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    if (armed_ == nullptr) {
      changed_.wait(lock);
      continue;
    }
    const char* watched = armed_;
    const auto since = since_;
    if (changed_.wait_until(lock, since + deadline_) == std::cv_status::no_timeout) continue;
    if (stopping_ || armed_ != watched || since_ != since) continue;  // it ended in time
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%g", static_cast<double>(deadline_.count()) / 1000.0);
    const std::string report =
        who_ + ": the collective " + watched + " did not complete within " + seconds +
        " s: another rank died or hangs (its own output says why); ending this rank (" +
        kCollectiveTimeoutVariable + " sets the deadline)";
    armed_ = nullptr;
    lock.unlock();
    expired_(report);
    lock.lock();
  }
}

void exit_on_expired_collective(const std::string& report) {
  std::fprintf(stderr, "octet: error: %s\n", report.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(kCollectiveTimeoutExit);
}

}  // namespace octet::dist
