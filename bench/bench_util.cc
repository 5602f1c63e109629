#include "bench_util.h"

#if OCTET_WITH_CUDA

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "octet/fp8/format.h"

namespace octet::bench {
namespace {

/// Calls before any timing: module load, cuBLASLt heuristics and pool growth stay out of the
/// numbers.
constexpr int kWarmupCalls = 3;
/// Calls of the batch that sizes the timed batches.
constexpr int kCalibrationCalls = 3;
/// Wall time of one timed batch: long against the ~5 us event and launch overheads, short enough
/// that a benchmark's 5 x 10 batches stay near a second.
constexpr double kTargetBatchSeconds = 0.02;
/// Upper bound on calls per batch (tiny ops would otherwise queue thousands of launches).
constexpr int kMaxCallsPerBatch = 2000;
/// Batches whose median gives a ceiling.
constexpr int kCeilingBatches = 7;
/// Fixed iterations (batches) per repetition; repetitions come from --benchmark_repetitions.
constexpr int kIterationsPerRepetition = 10;
/// Elements per chunk of the parallel host-side random fill.
constexpr int64_t kFillChunk = int64_t{1} << 20;
/// Scale exponents of random_scales: 2^-kMaxScaleExponent .. 2^-kMinScaleExponent.
constexpr int kMinScaleExponent = 2;
constexpr int kMaxScaleExponent = 8;

// splitmix64 (Steele, Lea and Flood, 2014): a stateless mix, so element i's value depends on i
// alone and the fill parallelizes without per-thread generators.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Uniform in [-1, 1) from 24 random bits; an exact zero becomes 1/3 (inputs are never zero).
float uniform_pm1(uint64_t bits) {
  constexpr float kTwoPowMinus24 = 5.9604644775390625e-08f;
  const float v = static_cast<float>(bits >> 40) * kTwoPowMinus24 * 2.0f - 1.0f;
  return v == 0.0f ? 1.0f / 3.0f : v;
}

/// A random FP8 byte that decodes to a finite number.
uint8_t finite_fp8(uint64_t bits, DType dtype) {
  auto b = static_cast<uint8_t>(bits);
  if (dtype == DType::e4m3) {
    if ((b & 0x7F) == 0x7F) b &= 0xFE;  // S.1111.111 is NaN: step down to +-448
  } else if (((b >> 2) & 0x1F) == 0x1F) {
    b &= 0xBF;  // exponent 31 is inf/NaN: clear its top bit
  }
  return b;
}

/// Fills a host tensor with the random contents random_tensor promises.
void fill_random(Tensor& host, uint64_t seed) {
  const DType dtype = host.dtype();
  const int64_t n = host.numel();
  void* data = host.raw_data();
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < (n + kFillChunk - 1) / kFillChunk; ++chunk) {
    const int64_t end = std::min(n, (chunk + 1) * kFillChunk);
    for (int64_t i = chunk * kFillChunk; i < end; ++i) {
      const uint64_t bits = mix(seed ^ static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull);
      switch (dtype) {
        case DType::f32:
          static_cast<float*>(data)[i] = uniform_pm1(bits);
          break;
        case DType::bf16:
          static_cast<uint16_t*>(data)[i] = fp8::encode_bf16(uniform_pm1(bits));
          break;
        default:
          static_cast<uint8_t*>(data)[i] = finite_fp8(bits, dtype);
          break;
      }
    }
  }
}

struct Events {
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
};

// Created once on device(); never destroyed, like octet's streams.
const Events& events() {
  static const Events events = [] {
    DeviceGuard guard(device());
    Events e;
    OCTET_CHECK_CUDA(cudaEventCreate(&e.start));
    OCTET_CHECK_CUDA(cudaEventCreate(&e.stop));
    return e;
  }();
  return events;
}

/// Seconds for `calls` back-to-back calls of `work` on stream().
double time_batch(int calls, const Work& work) {
  const Events& e = events();
  OCTET_CHECK_CUDA(cudaEventRecord(e.start, stream()));
  for (int i = 0; i < calls; ++i) work();
  OCTET_CHECK_CUDA(cudaEventRecord(e.stop, stream()));
  OCTET_CHECK_CUDA(cudaEventSynchronize(e.stop));
  float ms = 0;
  OCTET_CHECK_CUDA(cudaEventElapsedTime(&ms, e.start, e.stop));
  return ms * 1e-3;
}

/// Warms `work` up and returns how many calls make a batch of about kTargetBatchSeconds.
int calls_per_batch(const Work& work) {
  for (int i = 0; i < kWarmupCalls; ++i) work();
  OCTET_CHECK_CUDA(cudaStreamSynchronize(stream()));
  const double per_call = time_batch(kCalibrationCalls, work) / kCalibrationCalls;
  if (per_call <= 0) return kMaxCallsPerBatch;
  return static_cast<int>(
      std::clamp(std::ceil(kTargetBatchSeconds / per_call), 1.0, double{kMaxCallsPerBatch}));
}

}  // namespace

Device device() { return Device::cuda(0); }

cudaStream_t stream() { return cuda::stream(device()); }

double time_loop(benchmark::State& state, const Work& work) {
  const int calls = calls_per_batch(work);
  double total_seconds = 0;
  int64_t total_calls = 0;
  for (auto _ : state) {
    const double seconds = time_batch(calls, work);
    state.SetIterationTime(seconds / calls);
    total_seconds += seconds;
    total_calls += calls;
  }
  state.counters["calls_per_batch"] = calls;
  return total_calls > 0 ? total_seconds / static_cast<double>(total_calls) : 0.0;
}

double median_seconds_per_call(const Work& work) {
  const int calls = calls_per_batch(work);
  std::vector<double> per_call;
  for (int i = 0; i < kCeilingBatches; ++i) per_call.push_back(time_batch(calls, work) / calls);
  std::nth_element(per_call.begin(), per_call.begin() + kCeilingBatches / 2, per_call.end());
  return per_call[kCeilingBatches / 2];
}

double host_seconds_per_call(int calls, const Work& work) {
  constexpr int kBatches = 7;
  work();  // the first call plans
  OCTET_CHECK_CUDA(cudaStreamSynchronize(stream()));
  std::vector<double> per_call;
  for (int batch = 0; batch < kBatches; ++batch) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) work();
    const std::chrono::duration<double> host = std::chrono::steady_clock::now() - start;
    OCTET_CHECK_CUDA(cudaStreamSynchronize(stream()));
    per_call.push_back(host.count() / calls);
  }
  std::nth_element(per_call.begin(), per_call.begin() + kBatches / 2, per_call.end());
  return per_call[kBatches / 2];
}

double copy_bandwidth() { return copy_bandwidth_at(2.0 * static_cast<double>(kCopyBytes)); }

double copy_bandwidth_at(double bytes) {
  static auto* measured = new std::map<int64_t, double>;  // bandwidth by bytes copied
  const auto half = static_cast<int64_t>(bytes / 2);      // a copy of N bytes moves 2N
  OCTET_CHECK(half > 0 && static_cast<size_t>(half) <= kCopyBytes,
              "copy_bandwidth_at: expected 2 to ", 2 * kCopyBytes, " bytes, got ", bytes);
  auto [it, fresh] = measured->try_emplace(half, 0.0);
  if (fresh) {
    DeviceGuard guard(device());
    Tensor src = random_tensor({half}, DType::e4m3, kCopySlot);
    Tensor dst = Tensor::empty({half}, DType::u8, device());
    const double seconds = median_seconds_per_call([&] {
      OCTET_CHECK_CUDA(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), static_cast<size_t>(half),
                                       cudaMemcpyDeviceToDevice, stream()));
    });
    it->second = 2.0 * static_cast<double>(half) / seconds;
  }
  return it->second;
}

Tensor random_tensor(const Shape& shape, DType dtype, int slot) {
  OCTET_CHECK(dtype == DType::f32 || dtype == DType::bf16 || is_fp8(dtype),
              "random_tensor: expected f32, bf16, e4m3 or e5m2, got ", dtype_name(dtype));
  // One pool per (dtype, slot), regrown (and redrawn) when a larger tensor is asked for. Never
  // destroyed: freeing device memory during static destruction races the CUDA runtime's exit.
  static auto* pools = new std::map<std::pair<DType, int>, Tensor>;
  const int64_t numel = shape_numel(shape);
  Tensor& pool = (*pools)[{dtype, slot}];
  if (!pool.defined() || pool.numel() < numel) {
    Tensor host = Tensor::empty({numel}, dtype);
    fill_random(host,
                mix(kSeed + static_cast<uint64_t>(slot) * 0x100 + static_cast<uint64_t>(dtype)));
    pool = host.to(device());
  }
  return pool.slice(0, numel).view(shape);
}

Tensor random_scales(const Shape& shape) {
  Tensor host = Tensor::empty(shape, DType::f32);
  float* data = host.data<float>();
  constexpr int kExponents = kMaxScaleExponent - kMinScaleExponent + 1;
  for (int64_t i = 0; i < host.numel(); ++i) {
    const int exponent =
        kMinScaleExponent + static_cast<int>(mix(kSeed ^ ~static_cast<uint64_t>(i)) % kExponents);
    data[i] = std::ldexp(1.0f, -exponent);
  }
  return host.to(device());
}

Tensor filled_f32(const Shape& shape, float value) {
  Tensor host = Tensor::empty(shape, DType::f32);
  std::fill_n(host.data<float>(), host.numel(), value);
  return host.to(device());
}

void report_memory(benchmark::State& state, double seconds, double bytes, double actual_bytes) {
  constexpr double kGiga = 1e9;
  const double ceiling = copy_bandwidth();
  state.counters["GBps"] = bytes / seconds / kGiga;
  state.counters["GBps_actual"] = actual_bytes / seconds / kGiga;
  state.counters["ceiling_GBps"] = ceiling / kGiga;
  state.counters["ratio"] = bytes / seconds / ceiling;
  state.counters["ratio_same_size"] = bytes / seconds / copy_bandwidth_at(bytes);
  state.counters["floor_ms"] = bytes / ceiling * 1e3;
  state.counters["ms"] = seconds * 1e3;
  state.counters["bytes"] = bytes;
  state.counters["bytes_actual"] = actual_bytes;
}

void report_gemm(benchmark::State& state, double seconds, double flops, double ceiling_seconds) {
  constexpr double kTera = 1e12;
  const bool has_ceiling = ceiling_seconds > 0;
  state.counters["TFLOPS"] = flops / seconds / kTera;
  state.counters["ceiling_TFLOPS"] = has_ceiling ? flops / ceiling_seconds / kTera : 0.0;
  state.counters["ratio"] = has_ceiling ? ceiling_seconds / seconds : 0.0;
  state.counters["ceiling_ms"] = has_ceiling ? ceiling_seconds * 1e3 : 0.0;
  state.counters["ms"] = seconds * 1e3;
  state.counters["flops"] = flops;
}

void guarded(benchmark::State& state, const std::function<void()>& body) {
  try {
    DeviceGuard guard(device());
    body();
  } catch (const Unsupported& e) {
    state.SkipWithError((std::string(kUnsupportedPrefix) + e.what()).c_str());
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

benchmark::internal::Benchmark* configure(benchmark::internal::Benchmark* b) {
  return b->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(kIterationsPerRepetition);
}

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
