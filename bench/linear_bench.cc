// nn::Linear forward + backward at a transformer shape, FP8 (delayed scaling) against BF16, with
// every quantization included: one training microbatch of one layer with no accumulation, so the
// weight is cast again every call, the input and grad_output are quantized (with their transposed
// copies), and three GEMMs run (forward, dgrad, wgrad).
//
// Work: 3 x 2*M*K*N FLOPs = 6.6e12 at M=16384, K=N=8192. The FP8 row's "ratio" is its speedup
// over the BF16 path timed right after it in the same process (the target: >= 1.6x).
//
// linear/call_latency times one small microbatch (M=128, K=N=1024) the way
// python/bench/bench_linear.py times octet.torch.Linear: host wall time of a forward, a backward
// and a stream synchronize, the weight cast kept. The binding's per-call overhead is the
// difference of the two (issue 17's target: within 10 us).
#include "bench_util.h"

#if OCTET_WITH_CUDA

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "octet/fp8/recipe.h"
#include "octet/nn/autocast.h"
#include "octet/nn/fp8_state.h"
#include "octet/nn/linear.h"

namespace octet::bench {
namespace {

constexpr int64_t kTokens = 16384;
constexpr int64_t kIn = 8192;
constexpr int64_t kOut = 8192;
constexpr double kFlops = 3 * 2.0 * kTokens * kIn * kOut;

constexpr int64_t kSmallTokens = 128;
constexpr int64_t kSmallFeatures = 1024;
constexpr int kLatencyCalls = 200;

/// One microbatch of `layer`: forward under the FP8 recipe (or BF16 when `recipe` is null) and
/// backward, finalizing the FP8 state once per pass as a trainer does. new_step: the weights
/// changed since the last call (an optimizer step), so the weight cast is part of the work.
void microbatch(nn::Linear& layer, const Tensor& x, const Tensor& dy, const fp8::Recipe* recipe,
                nn::AmaxRegistry& registry, bool new_step = true) {
  if (new_step) layer.on_weights_updated();
  nn::Linear::Saved saved;
  if (recipe != nullptr) {
    {
      nn::Fp8Autocast scope(*recipe, registry);
      layer.forward(x, saved);
    }
    layer.backward(dy, saved);
    registry.finalize_backward();
  } else {
    layer.forward(x, saved);
    layer.backward(dy, saved);
  }
}

void bm_linear(benchmark::State& state, bool fp8) {
  guarded(state, [&] {
    nn::Linear layer(kIn, kOut, /*bias=*/true, device(), /*seed=*/1, DType::bf16);
    const Tensor x = random_tensor({kTokens, kIn}, DType::bf16, /*slot=*/0);
    const Tensor dy = random_tensor({kTokens, kOut}, DType::bf16, /*slot=*/1);
    nn::AmaxRegistry registry;
    const fp8::Recipe recipe = fp8::Recipe::delayed();
    const fp8::Recipe* active = fp8 ? &recipe : nullptr;
    const double seconds =
        time_loop(state, [&] { microbatch(layer, x, dy, active, registry); });
    double baseline = 0;  // the FP8 row compares with BF16 timed right after it
    if (fp8) baseline = median_seconds_per_call([&] { microbatch(layer, x, dy, nullptr, registry); });
    report_gemm(state, seconds, kFlops, baseline);
    state.SetLabel(fp8 ? "FP8 delayed; ratio = speedup over BF16" : "BF16");
  });
}

void bm_linear_call_latency(benchmark::State& state) {
  guarded(state, [&] {
    nn::Linear layer(kSmallFeatures, kSmallFeatures, /*bias=*/true, device(), /*seed=*/1,
                     DType::bf16);
    const Tensor x = random_tensor({kSmallTokens, kSmallFeatures}, DType::bf16, /*slot=*/0);
    const Tensor dy = random_tensor({kSmallTokens, kSmallFeatures}, DType::bf16, /*slot=*/1);
    nn::AmaxRegistry registry;
    const fp8::Recipe recipe = fp8::Recipe::delayed();
    const auto call_seconds = [&] {
      const auto start = std::chrono::steady_clock::now();
      microbatch(layer, x, dy, &recipe, registry, /*new_step=*/false);
      OCTET_CHECK_CUDA(cudaStreamSynchronize(stream()));
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    for (int i = 0; i < 10; ++i) call_seconds();  // warm-up: plans, casts, allocator
    double median = 0;
    for (auto _ : state) {
      std::vector<double> times(kLatencyCalls);
      for (double& t : times) t = call_seconds();
      std::nth_element(times.begin(), times.begin() + kLatencyCalls / 2, times.end());
      median = times[kLatencyCalls / 2];
      state.SetIterationTime(median);
    }
    state.counters["ms"] = median * 1e3;
    state.counters["us_per_call"] = median * 1e6;
    state.SetLabel("FP8 delayed, forward + backward + synchronize, host wall time (median)");
  });
}

}  // namespace

void register_linear_benchmarks() {
  const std::string shape = "M" + std::to_string(kTokens) + "_K" + std::to_string(kIn) + "_N" +
                            std::to_string(kOut);
  configure(benchmark::RegisterBenchmark(("linear/fwd_bwd/bf16/" + shape).c_str(),
                                         [](benchmark::State& s) { bm_linear(s, false); }));
  configure(benchmark::RegisterBenchmark(("linear/fwd_bwd/fp8_delayed/" + shape).c_str(),
                                         [](benchmark::State& s) { bm_linear(s, true); }));
  const std::string small = "M" + std::to_string(kSmallTokens) + "_K" +
                            std::to_string(kSmallFeatures) + "_N" + std::to_string(kSmallFeatures);
  configure(benchmark::RegisterBenchmark(("linear/call_latency/fp8_delayed/" + small).c_str(),
                                         bm_linear_call_latency));
}

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
