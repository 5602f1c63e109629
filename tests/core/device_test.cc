#include "octet/core/device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "octet/core/error.h"
#include "test_util.h"

#if OCTET_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace octet {
namespace {

using testing::error_of;
using ::testing::HasSubstr;

TEST(Device, ParseAcceptsCpuCudaAndCudaN) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu());
  EXPECT_EQ(Device::parse("cuda"), Device::cuda(0));
  EXPECT_EQ(Device::parse("cuda:0"), Device::cuda(0));
  EXPECT_EQ(Device::parse("cuda:7"), Device::cuda(7));
  EXPECT_EQ(Device::parse("cuda:12"), Device::cuda(12));
}

TEST(Device, ParseRejectsEverythingElse) {
  for (const char* text : {"", "gpu", "CPU", "cuda:", "cuda:-1", "cuda:1x", "cuda:+1", "cuda0",
                           " cpu", "cuda:1:2", "cuda:99999999999"}) {
    SCOPED_TRACE(text);
    EXPECT_THAT(
        error_of([&] { Device::parse(text); }),
        HasSubstr("unknown device '" + std::string(text) + "'; expected cpu, cuda or cuda:N"));
  }
}

TEST(Device, ParseListTakesOneKindWithBareIndicesAfterAGpu) {
  using V = std::vector<Device>;
  EXPECT_EQ(Device::parse_list("cuda:0,1"), (V{Device::cuda(0), Device::cuda(1)}));
  EXPECT_EQ(Device::parse_list("cuda:2,cuda:0,3"),
            (V{Device::cuda(2), Device::cuda(0), Device::cuda(3)}));
  EXPECT_EQ(Device::parse_list("cuda,1"), (V{Device::cuda(0), Device::cuda(1)}));
  EXPECT_EQ(Device::parse_list("cuda:0,0"), (V{Device::cuda(0), Device::cuda(0)}));
  EXPECT_EQ(Device::parse_list("cpu,cpu"), (V{Device::cpu(), Device::cpu()}));
  EXPECT_EQ(Device::parse_list("cuda:4"), (V{Device::cuda(4)}));
  EXPECT_EQ(Device::parse_list("cpu"), (V{Device::cpu()}));
  EXPECT_EQ(device_list_str({Device::cuda(0), Device::cuda(1)}), "cuda:0,cuda:1");
}

TEST(Device, ParseListNamesTheBadEntry) {
  for (const auto& [text, expected] : std::vector<std::pair<std::string, std::string>>{
           {"", "empty entry in the device list ''"},
           {"cuda:0,", "empty entry in the device list 'cuda:0,'"},
           {"cuda:0,,1", "empty entry"},
           {"cuda:0,1x", "unknown device '1x' in the device list 'cuda:0,1x'"},
           {"cpu,1", "unknown device '1' in the device list 'cpu,1'"},
           {"1,cuda:0", "unknown device '1'"},
           {"cuda:0,gpu", "unknown device 'gpu'"},
           {"cuda:0,cpu", "mixes the CPU and GPUs"},
           {"cpu,cuda:1", "mixes the CPU and GPUs"}}) {
    SCOPED_TRACE(text);
    EXPECT_THAT(error_of([&] { Device::parse_list(text); }), HasSubstr(expected));
  }
}

TEST(Device, StrAndEquality) {
  EXPECT_EQ(Device::cpu().str(), "cpu");
  EXPECT_EQ(Device::cuda(3).str(), "cuda:3");
  EXPECT_EQ(Device::parse(Device::cuda(5).str()), Device::cuda(5));
  EXPECT_NE(Device::cuda(0), Device::cuda(1));
  EXPECT_NE(Device::cpu(), Device::cuda(0));
  EXPECT_TRUE(Device::cpu().is_cpu());
  EXPECT_TRUE(Device::cuda(1).is_cuda());
  std::ostringstream out;
  out << Device::cuda(2);
  EXPECT_EQ(out.str(), "cuda:2");
}

TEST(Device, CheckDeviceAvailable) {
  EXPECT_NO_THROW(check_device_available(Device::cpu()));
  const int count = cuda_device_count();
  EXPECT_GE(count, 0);
  if (!built_with_cuda()) {
    EXPECT_EQ(count, 0);
    EXPECT_THAT(error_of([] { check_device_available(Device::cuda(0)); }),
                HasSubstr("device cuda:0 requested, but octet was built without CUDA"));
    return;
  }
  for (int i = 0; i < count; ++i) EXPECT_NO_THROW(check_device_available(Device::cuda(i)));
  for (int index : {count, count + 7}) {
    const Device missing = Device::cuda(index);
    EXPECT_THAT(error_of([&] { check_device_available(missing); }),
                HasSubstr("device " + missing.str() + " requested, but " + std::to_string(count) +
                          " CUDA GPU(s) are visible"));
  }
}

TEST(DeviceGuard, CpuIsANoOp) { EXPECT_NO_THROW(DeviceGuard guard(Device::cpu())); }

TEST(DeviceGuard, CudaWithoutTheBackend) {
  if (built_with_cuda()) GTEST_SKIP() << "built with CUDA";
  EXPECT_THAT(error_of([] { DeviceGuard guard(Device::cuda(0)); }),
              HasSubstr("device cuda:0 requested, but octet was built without CUDA"));
}

#if OCTET_WITH_CUDA
int current_device() {
  int device = -1;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  return device;
}

/// Skips unless two GPUs are visible: restoring is only observable with a second device.
#define OCTET_SKIP_UNLESS_TWO_GPUS()                                         \
  do {                                                                       \
    if (cuda_device_count() < 2)                                             \
      GTEST_SKIP() << "needs 2 GPUs, " << cuda_device_count() << " visible"; \
  } while (false)

TEST(DeviceGuard, RestoresThePreviousDevice) {
  OCTET_SKIP_UNLESS_TWO_GPUS();
  for (int ambient : {0, 1}) {
    ASSERT_EQ(cudaSetDevice(ambient), cudaSuccess);
    {
      DeviceGuard guard(Device::cuda(1 - ambient));
      EXPECT_EQ(current_device(), 1 - ambient);
      {
        DeviceGuard nested(Device::cuda(ambient));
        EXPECT_EQ(current_device(), ambient);
      }
      EXPECT_EQ(current_device(), 1 - ambient);
      DeviceGuard cpu(Device::cpu());  // does not touch the CUDA device
      EXPECT_EQ(current_device(), 1 - ambient);
    }
    EXPECT_EQ(current_device(), ambient);
  }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

TEST(DeviceGuard, RestoresWhenAnExceptionLeavesTheScope) {
  OCTET_SKIP_UNLESS_TWO_GPUS();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_THROW(
      {
        DeviceGuard guard(Device::cuda(1));
        EXPECT_EQ(current_device(), 1);
        throw std::runtime_error("preparation failed");
      },
      std::runtime_error);
  EXPECT_EQ(current_device(), 0);
}

TEST(DeviceGuard, SameDeviceStaysPut) {
  OCTET_SKIP_IF_UNAVAILABLE(Device::cuda(0));
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  {
    DeviceGuard guard(Device::cuda(0));
    EXPECT_EQ(current_device(), 0);
  }
  EXPECT_EQ(current_device(), 0);
}
#else
TEST(DeviceGuard, RestoresThePreviousDevice) { GTEST_SKIP() << "built without CUDA"; }
TEST(DeviceGuard, RestoresWhenAnExceptionLeavesTheScope) { GTEST_SKIP() << "built without CUDA"; }
#endif

}  // namespace
}  // namespace octet
