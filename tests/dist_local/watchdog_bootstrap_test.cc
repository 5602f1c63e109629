// The parts of the dist layer that need no second process (they run in octet_tests): the
// collective watchdog, the TCP exchange of the NCCL id under torchrun's variables, and the
// ordered keys of the NCCL MAX.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "dist/ordered_key.h"
#include "octet/core/error.h"
#include "octet/dist/bootstrap.h"
#include "octet/dist/communicator.h"
#include "octet/dist/watchdog.h"
#include "test_util.h"

namespace octet::dist {
namespace {

using namespace std::chrono_literals;

TEST(DistWatchdog, ReportsACollectivePastItsDeadlineAndNotOneThatEndsInTime) {
  std::atomic<int> reports{0};
  std::string report;
  std::mutex mutex;
  CollectiveWatchdog watchdog(100ms, "rank 1 of 2", [&](const std::string& r) {
    std::lock_guard lock(mutex);
    report = r;
    ++reports;
  });
  {
    CollectiveWatchdog::Scope quick(watchdog, "barrier");
  }
  std::this_thread::sleep_for(250ms);
  EXPECT_EQ(reports.load(), 0) << "a collective that ended in time was reported";
  {
    CollectiveWatchdog::Scope stuck(watchdog, "all_reduce");
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (reports.load() == 0 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(reports.load(), 1);
  std::lock_guard lock(mutex);
  EXPECT_NE(report.find("rank 1 of 2: the collective all_reduce did not complete within 0.1 s"),
            std::string::npos)
      << report;
}

TEST(DistWatchdog, TheDeadlineComesFromTheEnvironment) {
  const char* saved = std::getenv(kCollectiveTimeoutVariable);
  const std::string before = saved ? saved : "";
  unsetenv(kCollectiveTimeoutVariable);
  EXPECT_EQ(collective_deadline(), std::chrono::seconds(kDefaultCollectiveTimeoutSeconds));
  setenv(kCollectiveTimeoutVariable, "2.5", 1);
  EXPECT_EQ(collective_deadline(), 2500ms);
  setenv(kCollectiveTimeoutVariable, "soon", 1);
  EXPECT_NE(testing::error_of([] { collective_deadline(); }).find("positive number of seconds"),
            std::string::npos);
  if (saved)
    setenv(kCollectiveTimeoutVariable, before.c_str(), 1);
  else
    unsetenv(kCollectiveTimeoutVariable);
}

TEST(DistBootstrap, RankZeroHandsItsIdToEveryOtherRankOverTcp) {
  std::mt19937_64 gen(testing::fresh_seed());
  UniqueIdBytes id;
  for (char& c : id) c = static_cast<char>(gen());
  UniqueIdServer server(0);  // any free port, as MASTER_PORT would name one
  ASSERT_GT(server.port(), 0);
  constexpr int kOthers = 3;
  std::vector<UniqueIdBytes> received(kOthers);
  std::vector<std::string> errors(kOthers);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kOthers; ++r)
    ranks.emplace_back([&, r] {
      try {
        received[r] = fetch_unique_id("localhost", server.port(), 10s);
      } catch (const Error& e) {
        errors[r] = e.message();
      }
    });
  server.serve(id, kOthers, 10s);
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < kOthers; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r + 1;
    EXPECT_EQ(received[r], id) << "rank " << r + 1;
  }
}

TEST(DistBootstrap, MissingRanksAndAnAbsentRankZeroFailWithinTheDeadline) {
  UniqueIdServer server(0);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NE(testing::error_of([&] { server.serve(UniqueIdBytes{}, 1, 200ms); })
                .find("handed the NCCL id to 0 of 1 ranks"),
            std::string::npos);
  // Nobody listens on a port that a closed server held: the rank gives up at its deadline.
  int free_port = 0;
  {
    UniqueIdServer closed(0);
    free_port = closed.port();
  }
  EXPECT_NE(testing::error_of([&] { fetch_unique_id("127.0.0.1", free_port, 300ms); })
                .find("no NCCL id from rank 0 at 127.0.0.1"),
            std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(DistBootstrap, TorchrunVariablesAreReadAndCheckedWhenWorldSizeIsSet) {
  const char* names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
  std::vector<std::optional<std::string>> saved;
  for (const char* n : names)
    saved.push_back(std::getenv(n) ? std::optional<std::string>(std::getenv(n)) : std::nullopt);
  for (const char* n : names) unsetenv(n);
  EXPECT_FALSE(torchrun_environment().has_value());
  setenv("WORLD_SIZE", "2", 1);
  setenv("RANK", "1", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("MASTER_ADDR", "node0", 1);
  setenv("MASTER_PORT", "29500", 1);
  const auto env = torchrun_environment();
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->rank, 1);
  EXPECT_EQ(env->world_size, 2);
  EXPECT_EQ(env->master_addr, "node0");
  EXPECT_EQ(env->master_port, 29500);
  EXPECT_EQ(launcher_local_rank(), 1);
  setenv("RANK", "2", 1);
  EXPECT_NE(testing::error_of([] { torchrun_environment(); }).find("RANK 2 is not a rank"),
            std::string::npos);
  setenv("RANK", "0", 1);
  setenv("MASTER_PORT", "70000", 1);
  EXPECT_NE(testing::error_of([] { torchrun_environment(); }).find("MASTER_PORT"),
            std::string::npos);
  for (size_t i = 0; i < saved.size(); ++i) {
    if (saved[i])
      setenv(names[i], saved[i]->c_str(), 1);
    else
      unsetenv(names[i]);
  }
}

TEST(DistDevices, ALaunchedRanksListFollowsTheLowerLocalRanksGpus) {
  const auto devices = [](const char* list, int local_rank) {
    return device_list_str(devices_for_local_rank(list, local_rank));
  };
  EXPECT_EQ(devices("cuda", 3), "cuda:3");  // plain cuda: the local rank's GPU
  EXPECT_EQ(devices("cuda:0,1", 0), "cuda:0,cuda:1");
  EXPECT_EQ(devices("cuda:0,1", 1), "cuda:2,cuda:3");
  EXPECT_EQ(devices("cuda:0,0", 1), "cuda:1,cuda:1");  // stages sharing a GPU share the next
  EXPECT_EQ(devices("cuda:0,2", 1), "cuda:3,cuda:5");  // past the list's largest index
  EXPECT_EQ(devices("cpu,cpu", 1), "cpu,cpu");
  EXPECT_EQ(devices("cuda:5", 1), "cuda:5");  // one named device is taken as named
}

TEST(DistOrderedKey, KeysOrderLikeTheFloatsWithNaNOnTopAndRoundTrip) {
  const float inf = std::numeric_limits<float>::infinity();
  const float denormal = std::numeric_limits<float>::denorm_min();
  std::vector<float> ordered{-inf, -3.5e38f, -1.0f, -denormal, -0.0f, 0.0f,
                             denormal, 1e-30f, 1.0f, 3.5e38f, inf};
  std::mt19937_64 gen(testing::fresh_seed());
  std::normal_distribution<float> normal(0.0f, 100.0f);
  for (int i = 0; i < 1000; ++i) ordered.push_back(normal(gen));
  std::sort(ordered.begin(), ordered.end());
  // Strictly increasing floats get strictly increasing keys; -0 and +0 (equal floats) get
  // distinct keys, so their MAX is +0, as fmax's may be.
  for (size_t i = 0; i + 1 < ordered.size(); ++i)
    if (ordered[i] < ordered[i + 1])
      ASSERT_LT(ordered_key(ordered[i]), ordered_key(ordered[i + 1])) << ordered[i];
  EXPECT_LT(ordered_key(-0.0f), ordered_key(0.0f));
  for (float x : ordered)
    ASSERT_EQ(fp8::float_bits(from_ordered_key(ordered_key(x))), fp8::float_bits(x)) << x;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_GT(ordered_key(nan), ordered_key(inf));
  EXPECT_GT(ordered_key(-nan), ordered_key(inf)) << "a NaN with its sign bit set wins too";
  EXPECT_TRUE(std::isnan(from_ordered_key(ordered_key(-nan))));
}

}  // namespace
}  // namespace octet::dist
