// GEMM benchmarks: octet's ops::gemm against the raw cuBLASLt call for the same shape, dtypes,
// TN layout, scale modes and accumulation, both timed in the same process. Each shape registers
// the raw call ("cublaslt") and octet's ("octet"); both report the raw call's median as ceiling.
// gemm/host_cost/* times the host side of one call instead: what an MoE layer pays per expert.
#include "bench_util.h"
#include "cublaslt_gemm.h"

#if OCTET_WITH_CUDA

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "octet/ops/gemm.h"

namespace octet::bench {
namespace {

struct GemmCase {
  const char* family;
  DType dtype;  ///< of A and B
  fp8::ScalingMode a_mode = fp8::ScalingMode::per_tensor;
  fp8::ScalingMode b_mode = fp8::ScalingMode::per_tensor;
  ops::Accumulation accumulation = ops::Accumulation::split;
};

struct GemmShape {
  int64_t m, n, k;
};

/// Forward FP8 GEMM of the per-tensor recipes: E4M3 x E4M3, fast accumulation, bf16 out.
const GemmCase kFp8Tensor{"fp8_tensor_fast", DType::e4m3, fp8::ScalingMode::per_tensor,
                          fp8::ScalingMode::per_tensor, ops::Accumulation::fast};
/// The BF16 GEMM FP8 is meant to beat.
const GemmCase kBf16{"bf16", DType::bf16};
/// The block recipe's forward GEMM: 1x128 activations x 128x128 weights. Split accumulation:
/// its per-block scales are applied at FP32 promotions anyway, and PyTorch's scaled_mm refuses
/// fast accumulation with cuBLASLt's block scale modes.
const GemmCase kFp8Block{"fp8_block_1x128_128x128", DType::e4m3, fp8::ScalingMode::block_1x128,
                         fp8::ScalingMode::block_128x128, ops::Accumulation::split};

/// The shapes: a cube, then M = 16384 tokens with K, N over typical hidden sizes.
constexpr GemmShape kCube{8192, 8192, 8192};
constexpr int64_t kTokens = 16384;
constexpr int64_t kHiddenSizes[] = {4096, 8192, 16384};

std::string shape_name(const GemmShape& s) {
  return detail::concat("M", s.m, "_N", s.n, "_K", s.k);
}

/// A [m, k] and B [n, k] (K-contiguous, B used transposed), D [m, n] bf16, and the scales in
/// octet's layout (QuantizedTensor) and in cuBLASLt's (sizes differ for block modes; values are
/// random powers of two either way, which is all the timing depends on).
struct GemmInputs {
  Tensor a, b, d;
  Tensor a_scale, b_scale;
  Tensor lt_a_scale, lt_b_scale;
};

GemmInputs make_inputs(const GemmCase& c, const GemmShape& s) {
  GemmInputs in;
  in.a = random_tensor({s.m, s.k}, c.dtype, 0);
  in.b = random_tensor({s.n, s.k}, c.dtype, 1);
  in.d = Tensor::empty({s.m, s.n}, DType::bf16, device());
  if (is_fp8(c.dtype)) {
    in.a_scale = random_scales(fp8::scale_shape(c.a_mode, s.m, s.k));
    in.b_scale = random_scales(fp8::scale_shape(c.b_mode, s.n, s.k));
    in.lt_a_scale = random_scales({LtGemm::scale_elements(c.a_mode, s.m, s.k)});
    in.lt_b_scale = random_scales({LtGemm::scale_elements(c.b_mode, s.n, s.k)});
  }
  return in;
}

const void* data_or_null(const Tensor& t) { return t.defined() ? t.raw_data() : nullptr; }

LtGemmConfig lt_config(const GemmCase& c, const GemmShape& s) {
  LtGemmConfig config;
  config.m = s.m;
  config.n = s.n;
  config.k = s.k;
  config.dtype = c.dtype;
  config.a_mode = c.a_mode;
  config.b_mode = c.b_mode;
  config.fast_accumulation = c.accumulation == ops::Accumulation::fast;
  return config;
}

struct Ceiling {
  double seconds = 0;
  std::string unsupported;  ///< why cuBLASLt cannot run this case (then seconds is 0)
};

/// The raw cuBLASLt time for (case, shape): the median of several batches, measured once per
/// process on first use and shared by the "cublaslt" and "octet" benchmarks of that shape.
const Ceiling& ceiling(const GemmCase& c, const GemmShape& s, const GemmInputs& in) {
  static std::map<std::string, Ceiling> cache;
  const std::string key = std::string(c.family) + "/" + shape_name(s);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  Ceiling result;
  try {
    LtGemm lt(lt_config(c, s), data_or_null(in.lt_a_scale), data_or_null(in.lt_b_scale));
    result.seconds = median_seconds_per_call(
        [&] { lt.run(in.a.raw_data(), in.b.raw_data(), in.d.raw_data(), stream()); });
  } catch (const Unsupported& e) {
    result.unsupported = e.what();
  }
  return cache[key] = result;
}

double flops(const GemmShape& s) {
  return 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
}

void bm_cublaslt(benchmark::State& state, const GemmCase& c, const GemmShape& s) {
  guarded(state, [&] {
    const GemmInputs in = make_inputs(c, s);
    const Ceiling& reference = ceiling(c, s, in);
    if (!reference.unsupported.empty()) throw Unsupported(reference.unsupported);
    LtGemm lt(lt_config(c, s), data_or_null(in.lt_a_scale), data_or_null(in.lt_b_scale));
    const double seconds = time_loop(
        state, [&] { lt.run(in.a.raw_data(), in.b.raw_data(), in.d.raw_data(), stream()); });
    report_gemm(state, seconds, flops(s), reference.seconds);
    state.SetLabel("raw cuBLASLt (ratio: this run vs its own median: noise check)");
  });
}

/// octet's operands over the inputs: A, and B used transposed.
std::pair<ops::GemmOperand, ops::GemmOperand> octet_operands(const GemmCase& c, const GemmShape& s,
                                                             const GemmInputs& in) {
  ops::GemmOperand a;
  ops::GemmOperand b;
  if (is_fp8(c.dtype)) {
    fp8::QuantizedTensor qa;
    qa.mode = c.a_mode;
    qa.dtype = c.dtype;
    qa.rows = s.m;
    qa.cols = s.k;
    qa.data = in.a;
    qa.scale_inv = in.a_scale;
    fp8::QuantizedTensor qb = qa;
    qb.mode = c.b_mode;
    qb.rows = s.n;
    qb.data = in.b;
    qb.scale_inv = in.b_scale;
    a = ops::GemmOperand::fp8(qa, /*use_transposed_copy=*/false);
    b = ops::GemmOperand::fp8(qb, /*use_transposed_copy=*/false, /*transpose=*/true);
  } else {
    a = ops::GemmOperand::dense(in.a);
    b = ops::GemmOperand::dense(in.b, /*transpose=*/true);
  }
  return {a, b};
}

void bm_octet(benchmark::State& state, const GemmCase& c, const GemmShape& s) {
  guarded(state, [&] {
    const GemmInputs in = make_inputs(c, s);
    const Ceiling& reference = ceiling(c, s, in);
    if (!reference.unsupported.empty()) throw Unsupported(reference.unsupported);
    const auto [a, b] = octet_operands(c, s, in);
    ops::GemmArgs args;
    args.accumulation = c.accumulation;
    const double seconds = time_loop(state, [&] { ops::gemm(a, b, in.d, args); });
    // The GPU's clock drifts by a few percent over a run (power and heat), so the ratio compares
    // against the raw call timed again right after octet's, on the same inputs.
    LtGemm lt(lt_config(c, s), data_or_null(in.lt_a_scale), data_or_null(in.lt_b_scale));
    const double raw_adjacent = median_seconds_per_call(
        [&] { lt.run(in.a.raw_data(), in.b.raw_data(), in.d.raw_data(), stream()); });
    report_gemm(state, seconds, flops(s), raw_adjacent);
    state.counters["ceiling_first_ms"] = reference.seconds * 1e3;
    state.SetLabel("octet ops::gemm vs raw cuBLASLt timed right after it");
  });
}

/// At kHostShape a GEMM's device time is a few microseconds, so host_seconds_per_call's launch
/// queue stays short and it times the host side alone.
constexpr GemmShape kHostShape{256, 256, 256};
constexpr int kHostCalls = 200;

/// The host side of one ops::gemm call against the raw cuBLASLt call with prebuilt descriptors.
void bm_host_cost(benchmark::State& state, const GemmCase& c) {
  guarded(state, [&] {
    const GemmInputs in = make_inputs(c, kHostShape);
    LtGemm lt(lt_config(c, kHostShape), data_or_null(in.lt_a_scale), data_or_null(in.lt_b_scale));
    const auto [a, b] = octet_operands(c, kHostShape, in);
    ops::GemmArgs args;
    args.accumulation = c.accumulation;
    for (auto _ : state) {
      const double octet = host_seconds_per_call(kHostCalls, [&] { ops::gemm(a, b, in.d, args); });
      const double raw = host_seconds_per_call(
          kHostCalls, [&] { lt.run(in.a.raw_data(), in.b.raw_data(), in.d.raw_data(), stream()); });
      state.SetIterationTime(octet);
      state.counters["host_us_octet"] = octet * 1e6;
      state.counters["host_us_cublaslt"] = raw * 1e6;
    }
    state.SetLabel("host time per enqueue: octet ops::gemm vs the raw cuBLASLt call");
  });
}

void register_case(const GemmCase& c, const GemmShape& s) {
  const std::string prefix = std::string("gemm/") + c.family + "/";
  configure(
      benchmark::RegisterBenchmark((prefix + "cublaslt/" + shape_name(s)).c_str(),
                                   [c, s](benchmark::State& state) { bm_cublaslt(state, c, s); }));
  configure(
      benchmark::RegisterBenchmark((prefix + "octet/" + shape_name(s)).c_str(),
                                   [c, s](benchmark::State& state) { bm_octet(state, c, s); }));
}

}  // namespace

void register_gemm_benchmarks() {
  register_case(kFp8Tensor, kCube);
  for (int64_t k : kHiddenSizes) {
    for (int64_t n : kHiddenSizes) register_case(kFp8Tensor, {kTokens, n, k});
  }
  register_case(kBf16, kCube);
  register_case(kFp8Block, kCube);
  for (const GemmCase* c : {&kFp8Tensor, &kBf16}) {
    configure(benchmark::RegisterBenchmark(
        (std::string("gemm/host_cost/") + c->family + "/" + shape_name(kHostShape)).c_str(),
        [c](benchmark::State& state) { bm_host_cost(state, *c); }));
  }
}

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
