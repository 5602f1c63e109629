// Shared machinery of octet_bench: event timing on octet's stream, random device inputs, the
// ceilings measured in the same run, and the counters every benchmark reports.
//
// Every benchmark reports its time next to a ceiling measured by this process (device-to-device
// copy bandwidth for memory-bound ops, the raw cuBLASLt call for GEMMs) and the ratio of the two,
// so a number never leans on a datasheet or on another day's run. docs/PERFORMANCE.md explains
// what each benchmark counts.
#pragma once

#if OCTET_WITH_CUDA

#include <benchmark/benchmark.h>
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

#include "octet/core/cuda_context.h"
#include "octet/core/tensor.h"

/// Throws octet::Error naming the cuBLASLt status and the failed call.
#define OCTET_BENCH_CHECK_CUBLAS(call)                                                     \
  do {                                                                                     \
    cublasStatus_t octet_status_ = (call);                                                 \
    if (octet_status_ != CUBLAS_STATUS_SUCCESS) {                                          \
      OCTET_ERROR("cuBLASLt error ", cublasLtGetStatusName(octet_status_), " in ", #call); \
    }                                                                                      \
  } while (false)

namespace octet::bench {

/// Seed of every random input (fixed, so runs on different days time the same data).
inline constexpr uint64_t kSeed = 0x0C7E7B3A5EEDull;

/// Thrown for a configuration the library under test does not support; the benchmark is then
/// skipped with a message that starts with kUnsupportedPrefix (gpu-check.sh counts those apart
/// from failures).
class Unsupported : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
inline constexpr const char* kUnsupportedPrefix = "unsupported: ";

/// The GPU every benchmark runs on (cuda:0).
Device device();
/// octet's stream on that GPU: every op, copy and raw cuBLASLt call of the benchmarks runs on it.
cudaStream_t stream();

/// One call of the work under test, enqueued on stream().
using Work = std::function<void()>;

/// Times `work` inside the benchmark loop. Warms up, sizes a batch of back-to-back calls to about
/// kTargetBatchSeconds, records CUDA events around each batch on stream(), and reports each
/// batch's mean per-call time as one iteration (manual time). Returns the mean seconds per call.
double time_loop(benchmark::State& state, const Work& work);

/// Median per-call seconds of `work` over several event-timed batches, outside any benchmark loop
/// (for the ceilings).
double median_seconds_per_call(const Work& work);

/// Host seconds per enqueue of `work`: the median over batches of `calls` calls timed on the host
/// clock before the stream is synchronized. Keep calls times the launches per call well below
/// the launch queue's depth (about a thousand), or the host waits for the GPU and the loop times
/// the device.
double host_seconds_per_call(int calls, const Work& work);

/// Device-to-device copy bandwidth of this GPU in bytes/s, counting bytes read plus bytes
/// written: cudaMemcpyAsync of a kCopyBytes buffer, measured once per process.
double copy_bandwidth();
/// The same for a copy that moves `bytes` (read plus written) in one call, measured once per size:
/// at tens of megabytes a launch's ramp and tail are a visible part of any kernel's time, the
/// copy's included, so this is the ceiling an op of that size can reach.
double copy_bandwidth_at(double bytes);
/// Bytes of each buffer of the copy ceiling.
inline constexpr size_t kCopyBytes = size_t{2} << 30;  // 2 GiB: ~40x the H200's 50 MB L2
/// random_tensor slot of the copy's source (random bytes, like every other input).
inline constexpr int kCopySlot = 7;

/// A tensor of `shape` on device() with random contents drawn once per process (seed kSeed):
/// f32/bf16 uniform in [-1, 1] with no zeros; e4m3/e5m2 random bytes with the NaN and inf codes
/// masked off. Tensors of one dtype and slot share storage, so use distinct slots for operands
/// that must not alias.
Tensor random_tensor(const Shape& shape, DType dtype, int slot = 0);
/// f32 tensor on device() of random powers of two in [2^-8, 2^-2] (scale_inv values).
Tensor random_scales(const Shape& shape);
/// f32 tensor on device() with every element `value`.
Tensor filled_f32(const Shape& shape, float value);

/// Counters of a memory-bound benchmark: GB/s for `bytes` (the convention), GB/s for
/// `actual_bytes` (everything the op touches, scales included), the copy ceiling, the ratio of
/// GB/s to it, the floor time at the ceiling and the measured time; and the ratio to a copy that
/// moves the op's `bytes` (ratio_same_size), for ops far smaller than the 2 GiB copy.
void report_memory(benchmark::State& state, double seconds, double bytes, double actual_bytes);
/// Counters of a GEMM benchmark: TFLOP/s, the ceiling's TFLOP/s and the ratio (0 when there is
/// no ceiling: ceiling_seconds <= 0), and the measured time.
void report_gemm(benchmark::State& state, double seconds, double flops, double ceiling_seconds);

/// Runs `body` under a DeviceGuard for device(); turns an exception into SkipWithError (with
/// kUnsupportedPrefix for Unsupported), so one failing op does not end the whole run.
void guarded(benchmark::State& state, const std::function<void()>& body);

/// Applies the settings all benchmarks share (manual time, ms, fixed iterations per repetition).
benchmark::internal::Benchmark* configure(benchmark::internal::Benchmark* b);

/// Registration hooks of the benchmark files; main calls them in this order.
void register_memory_benchmarks();
void register_gemm_benchmarks();
void register_grouped_gemm_benchmarks();
void register_linear_benchmarks();
void register_attention_benchmarks();
void register_moe_benchmarks();

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
