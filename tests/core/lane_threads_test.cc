#include "core/lane_threads.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <latch>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "octet/core/error.h"

namespace octet {
namespace {

using ::testing::HasSubstr;

/// Long enough that lanes which really run at once always meet; lanes run one after another
/// would wait this long and report that they never met.
constexpr auto kMeetDeadline = std::chrono::seconds(30);

/// Counts down `latch` and waits for every other lane; false if they did not all arrive in time.
bool meet(std::latch& latch) {
  latch.count_down();
  const auto deadline = std::chrono::steady_clock::now() + kMeetDeadline;
  while (!latch.try_wait()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

TEST(LaneThreads, EveryLaneRunsOnceOnItsOwnThreadLaneZeroOnTheCaller) {
  constexpr int kLanes = 4, kCalls = 200;
  const long long inline_before = lanes_run_inline();
  for (int call = 0; call < kCalls; ++call) {
    std::mutex mutex;
    std::vector<int> runs(kLanes, 0);
    std::vector<std::thread::id> ids(kLanes);
    run_on_lanes(kLanes, [&](int lane) {
      std::lock_guard lock(mutex);
      ++runs[lane];
      ids[lane] = std::this_thread::get_id();
    });
    EXPECT_EQ(runs, std::vector<int>(kLanes, 1)) << "call " << call;
    EXPECT_EQ(ids[0], std::this_thread::get_id()) << "call " << call;
    EXPECT_EQ(std::set<std::thread::id>(ids.begin(), ids.end()).size(), size_t{kLanes})
        << "call " << call;
  }
  EXPECT_EQ(lanes_run_inline(), inline_before);
}

TEST(LaneThreads, LanesRunAtOnce) {
  for (int lanes = 2; lanes <= kMaxLanes; ++lanes) {
    std::latch latch(lanes);
    std::atomic<int> met{0};
    run_on_lanes(lanes, [&](int) { met += meet(latch) ? 1 : 0; });
    EXPECT_EQ(met.load(), lanes) << lanes << " lanes did not all run at the same time";
  }
}

TEST(LaneThreads, OneLaneRunsOnTheCaller) {
  std::thread::id id;
  run_on_lanes(1, [&](int lane) {
    EXPECT_EQ(lane, 0);
    id = std::this_thread::get_id();
  });
  EXPECT_EQ(id, std::this_thread::get_id());
}

TEST(LaneThreads, AWorkersExceptionComesBackAfterEveryLaneFinished) {
  std::atomic<bool> slow_lane_done{false};
  try {
    run_on_lanes(4, [&](int lane) {
      if (lane == 2) OCTET_ERROR("lane 2 failed");
      if (lane == 3) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        slow_lane_done = true;
      }
    });
    FAIL() << "expected lane 2's error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("lane 2 failed"));
  }
  EXPECT_TRUE(slow_lane_done.load());
  // The threads are reusable after a failure, and the old error does not come back.
  std::atomic<int> runs{0};
  run_on_lanes(4, [&](int) { ++runs; });
  EXPECT_EQ(runs.load(), 4);
}

TEST(LaneThreads, TheLowestFailingLaneWins) {
  for (const int first : {0, 1}) {
    try {
      run_on_lanes(4, [&](int lane) {
        if (lane >= first) OCTET_ERROR("lane ", lane, " failed");
      });
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("lane " + std::to_string(first) + " failed"));
    }
  }
}

TEST(LaneThreads, ACallFromAJobRunsItsLanesInline) {
  const long long inline_before = lanes_run_inline();
  std::vector<std::thread::id> inner(3);
  run_on_lanes(2, [&](int lane) {
    if (lane != 0) return;
    run_on_lanes(3, [&](int inner_lane) { inner[inner_lane] = std::this_thread::get_id(); });
  });
  EXPECT_EQ(lanes_run_inline(), inline_before + 1);
  EXPECT_EQ(inner, std::vector<std::thread::id>(3, std::this_thread::get_id()));
}

TEST(LaneThreads, TwoCallersAtOnceBothRunEveryLane) {
  constexpr int kCalls = 100, kLanes = 4;
  std::atomic<int> runs[2] = {0, 0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 2; ++c) {
    callers.emplace_back([&, c] {
      for (int call = 0; call < kCalls; ++call) run_on_lanes(kLanes, [&](int) { ++runs[c]; });
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(runs[0].load(), kCalls * kLanes);
  EXPECT_EQ(runs[1].load(), kCalls * kLanes);
}

TEST(LaneThreads, BadLaneCountsAreRefused) {
  for (const int lanes : {0, -1, kMaxLanes + 1}) {
    try {
      run_on_lanes(lanes, [](int) {});
      FAIL() << "expected a refusal of " << lanes << " lanes";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("lanes must be 1 to " + std::to_string(kMaxLanes)));
    }
  }
}

TEST(LaneThreads, AForkedChildMakesItsOwnThreads) {
  run_on_lanes(4, [](int) {});  // the parent's threads exist before the fork
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::latch latch(4);
    std::atomic<int> met{0};
    run_on_lanes(4, [&](int) { met += meet(latch) ? 1 : 0; });
    _exit(met.load() == 4 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's lanes did not run at once";
}

}  // namespace
}  // namespace octet
