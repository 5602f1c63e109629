// Per-call host time of one Linear forward+backward through octet's C++ API (nn::Linear), the
// floor that linear_capi.c and overhead.py compare the bindings with. Mirrors bench/linear_bench.cc
// (bm_linear_call_latency): FP8 delayed scaling, a scope per forward, finalize after backward.
//   linear_cpp DEVICE M K N CALLS  ->  one JSON line {"us": wall, "cpu_us": this thread's CPU}
// (medians per call, in microseconds).
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "octet/core/tensor.h"
#include "octet/fp8/recipe.h"
#include "octet/nn/autocast.h"
#include "octet/nn/fp8_state.h"
#include "octet/nn/linear.h"
#if OCTET_WITH_CUDA
#include "octet/core/cuda_context.h"
#endif

int main(int argc, char** argv) {
  using namespace octet;
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s DEVICE M K N CALLS\n", argv[0]);
    return 2;
  }
  const Device device = Device::parse(argv[1]);
  const int64_t m = std::atoll(argv[2]), k = std::atoll(argv[3]), n = std::atoll(argv[4]);
  const int calls = std::atoi(argv[5]);
  nn::Linear layer(k, n, /*bias=*/true, device, /*seed=*/1, DType::f32);
  std::vector<float> host_x(m * k, 0.5f), host_dy(m * n, 0.25f);
  const Tensor x = Tensor::from_vector(host_x, {m, k}).to(device);
  const Tensor dy = Tensor::from_vector(host_dy, {m, n}).to(device);
  nn::AmaxRegistry registry;
  const fp8::Recipe recipe = fp8::Recipe::delayed();
  const auto seconds = [](clockid_t clock) {
    timespec t;
    clock_gettime(clock, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  };
  const auto call = [&] {
    nn::Linear::Saved saved;
    {
      nn::Fp8Autocast scope(recipe, registry);
      layer.forward(x, saved);
    }
    layer.backward(dy, saved);
    registry.finalize_backward();
#if OCTET_WITH_CUDA
    if (device.is_cuda()) cuda::synchronize(device);
#endif
  };
  for (int i = 0; i < 20; ++i) call();
  std::vector<double> wall(calls), cpu(calls);
  for (int i = 0; i < calls; ++i) {
    const double w = seconds(CLOCK_MONOTONIC), c = seconds(CLOCK_THREAD_CPUTIME_ID);
    call();
    cpu[i] = seconds(CLOCK_THREAD_CPUTIME_ID) - c;
    wall[i] = seconds(CLOCK_MONOTONIC) - w;
  }
  std::nth_element(wall.begin(), wall.begin() + calls / 2, wall.end());
  std::nth_element(cpu.begin(), cpu.begin() + calls / 2, cpu.end());
  std::printf("{\"us\": %.3f, \"cpu_us\": %.3f}\n", wall[calls / 2] * 1e6, cpu[calls / 2] * 1e6);
  return 0;
}
