// nn::Linear forward + backward at a transformer shape, FP8 (delayed scaling) against BF16, with
// every quantization included: one training microbatch of one layer with no accumulation, so the
// weight is cast again every call, the input and grad_output are quantized (with their transposed
// copies), and three GEMMs run (forward, dgrad, wgrad).
//
// Work: 3 x 2*M*K*N FLOPs = 6.6e12 at M=16384, K=N=8192. The FP8 row's "ratio" is its speedup
// over the BF16 path timed right after it in the same process (the target: >= 1.6x).
#include "bench_util.h"

#if OCTET_WITH_CUDA

#include <string>

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

/// One microbatch of `layer`: forward under the FP8 recipe (or BF16 when `recipe` is null) and
/// backward, finalizing the FP8 state once per pass as a trainer does.
void microbatch(nn::Linear& layer, const Tensor& x, const Tensor& dy, const fp8::Recipe* recipe,
                nn::AmaxRegistry& registry) {
  layer.on_weights_updated();  // a new optimizer step: the weight cast is part of the work
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

}  // namespace

void register_linear_benchmarks() {
  const std::string shape = "M" + std::to_string(kTokens) + "_K" + std::to_string(kIn) + "_N" +
                            std::to_string(kOut);
  configure(benchmark::RegisterBenchmark(("linear/fwd_bwd/bf16/" + shape).c_str(),
                                         [](benchmark::State& s) { bm_linear(s, false); }));
  configure(benchmark::RegisterBenchmark(("linear/fwd_bwd/fp8_delayed/" + shape).c_str(),
                                         [](benchmark::State& s) { bm_linear(s, true); }));
}

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
