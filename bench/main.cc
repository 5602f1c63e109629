// octet_bench: octet's CUDA ops against ceilings measured in the same run. Google Benchmark's
// flags apply: --benchmark_filter=REGEX picks benchmarks by name ("mem/", "gemm/.*/octet/",
// "copy"), --benchmark_out=FILE --benchmark_out_format=json writes the machine-readable record.
// Defaults added here (later flags override them): 5 repetitions, aggregates only, so every
// number reported is the median (and mean, stddev, cv) of 5 repetitions.
#include <cstdio>
#include <string>
#include <vector>

#if OCTET_WITH_CUDA
#include <cuda_runtime.h>

#include "bench_util.h"
#include "octet/core/cuda_context.h"
#include "octet/core/device.h"
#endif

namespace {

/// Flags placed before the user's, so that the user's win.
const char* const kDefaultFlags[] = {
    "--benchmark_repetitions=5",
    "--benchmark_report_aggregates_only=true",
    "--benchmark_counters_tabular=true",
};

}  // namespace

int main(int argc, char** argv) {
#if OCTET_WITH_CUDA
  std::vector<char*> args{argv[0]};
  for (const char* flag : kDefaultFlags) args.push_back(const_cast<char*>(flag));
  bool listing = false;  // --benchmark_list_tests needs no GPU: the names are known up front
  for (int i = 1; i < argc; ++i) {
    args.push_back(argv[i]);
    const std::string arg = argv[i];
    if (arg == "--benchmark_list_tests" || arg == "--benchmark_list_tests=true") listing = true;
  }
  int count = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&count, args.data());
  if (benchmark::ReportUnrecognizedArguments(count, args.data())) return 1;

  if (!listing) {
    if (octet::cuda_device_count() == 0) {
      std::fprintf(stderr, "octet_bench: no CUDA GPU is visible; nothing to measure\n");
      return 1;
    }
    const cudaDeviceProp& props = octet::cuda::properties(octet::bench::device());
    int runtime_version = 0;
    cudaRuntimeGetVersion(&runtime_version);
    benchmark::AddCustomContext("gpu", props.name);
    benchmark::AddCustomContext("gpu_sms", std::to_string(props.multiProcessorCount));
    benchmark::AddCustomContext("cuda_runtime", std::to_string(runtime_version));
    benchmark::AddCustomContext("cublaslt", std::to_string(cublasLtGetVersion()));
    benchmark::AddCustomContext("input_seed", std::to_string(octet::bench::kSeed));
  }

  octet::bench::register_memory_benchmarks();
  octet::bench::register_gemm_benchmarks();
  octet::bench::register_grouped_gemm_benchmarks();
  octet::bench::register_linear_benchmarks();
  octet::bench::register_attention_benchmarks();
  octet::bench::register_moe_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
#else
  (void)argc;
  (void)argv;
  (void)kDefaultFlags;
  std::fprintf(stderr,
               "octet_bench measures the CUDA backend; configure with -DOCTET_WITH_CUDA=ON\n");
  return 1;
#endif
}
