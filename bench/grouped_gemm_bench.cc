// Grouped GEMM benchmarks: ops::grouped_gemm over 16 groups of an expert-contiguous buffer (issue
// 13's shape, and moe-16x2048's smallest expert GEMM), balanced and skewed, against one dense
// ops::gemm with the same total FLOPs timed in the same process; the ratio is grouped TFLOP/s over
// dense (target >= 0.85 at the issue's shape), and host_us the host time of one enqueue. The
// label carries the grouped-matmul capability probe's answer.
#include "bench_util.h"

#if OCTET_WITH_CUDA

#include <string>
#include <vector>

#include "octet/ops/gemm.h"
#include "octet/ops/grouped_gemm.h"

namespace octet::bench {
namespace {

constexpr int64_t kGroups = 16;

/// One group's GEMM: rows (a balanced group's M), K and N.
struct GroupShape {
  int64_t rows, inner, outer;
};
/// The issue's benchmark shape, and moe-16x2048's FC2 (its smallest expert GEMM: about 9 GFLOP,
/// a few microseconds of tensor-core time, where issuing the calls is what costs).
constexpr GroupShape kIssueShape{1024, 4096, 4096};
constexpr GroupShape kPresetFc2{1024, 2048, 2048};
/// Grouped calls a host-time batch enqueues: 16 GEMMs each, well inside the launch queue.
constexpr int kHostCalls = 8;

enum class Split { balanced, skewed };

/// Rows per group: rows_per_group each, or half of all rows on groups 0 and 1 (4x that each) and
/// the rest spread evenly over the other 14 (rounded to the 16-row FP8 alignment; the last of
/// them takes the remainder).
std::vector<int64_t> offsets_for(Split split, int64_t rows_per_group) {
  const int64_t total = kGroups * rows_per_group;
  std::vector<int64_t> rows(kGroups, rows_per_group);
  if (split == Split::skewed) {
    rows[0] = rows[1] = total / 4;
    const int64_t rest = total / 2;
    const int64_t each = rest / (kGroups - 2) / 16 * 16;
    for (int64_t g = 2; g < kGroups; ++g) rows[g] = each;
    rows[kGroups - 1] = rest - each * (kGroups - 3);
  }
  std::vector<int64_t> offsets{0};
  for (int64_t r : rows) offsets.push_back(offsets.back() + r);
  return offsets;
}

/// An FP8 operand over `data` with per-tensor scale_inv (the scale values do not matter to time).
ops::GemmOperand fp8_operand(const Tensor& data, const Tensor& scale, bool transpose) {
  fp8::QuantizedTensor q;
  q.mode = fp8::ScalingMode::per_tensor;
  q.dtype = data.dtype();
  q.rows = data.rows();
  q.cols = data.cols();
  q.data = data;
  q.scale_inv = scale;
  return ops::GemmOperand::fp8(q, false, transpose);
}

ops::GemmOperand operand(const Tensor& data, const Tensor& scale, bool transpose) {
  return is_fp8(data.dtype()) ? fp8_operand(data, scale, transpose)
                              : ops::GemmOperand::dense(data, transpose);
}

void bm_grouped(benchmark::State& state, DType dtype, Split split, GroupShape shape) {
  guarded(state, [&] {
    const std::vector<int64_t> offsets = offsets_for(split, shape.rows);
    const int64_t rows = offsets.back();
    const Tensor x = random_tensor({rows, shape.inner}, dtype, 0);
    const Tensor w = random_tensor({kGroups * shape.outer, shape.inner}, dtype, 1);
    const Tensor scale = random_scales({1});
    const Tensor y = Tensor::empty({rows, shape.outer}, DType::bf16, device());
    std::vector<ops::GemmOperand> b;
    for (int64_t g = 0; g < kGroups; ++g)
      b.push_back(operand(w.slice(g * shape.outer, (g + 1) * shape.outer), scale, true));
    const ops::GemmOperand a = operand(x, scale, false);
    ops::GroupedGemmArgs args;
    args.accumulation = is_fp8(dtype) ? ops::Accumulation::fast : ops::Accumulation::split;
    const Work grouped = [&] { ops::grouped_gemm(std::span(&a, 1), b, y, offsets, args); };
    const double seconds = time_loop(state, grouped);
    // The ceiling: one dense GEMM of all rows against one expert's weight, same FLOPs, timed
    // right after (the clock drifts over a run).
    ops::GemmArgs dense_args;
    dense_args.accumulation = args.accumulation;
    const double dense = median_seconds_per_call([&] { ops::gemm(a, b[0], y, dense_args); });
    report_gemm(state, seconds, 2.0 * rows * shape.inner * shape.outer, dense);
    // Where the host's enqueueing is what limits the call, this nears the time above.
    state.counters["host_us"] = host_seconds_per_call(kHostCalls, grouped) * 1e6;
    state.SetLabel("vs one dense GEMM of the same FLOPs; " + ops::grouped_gemm_path(device()));
  });
}

std::string shape_name(GroupShape s) {
  return "G" + std::to_string(kGroups) + "_M" + std::to_string(s.rows) + "_N" +
         std::to_string(s.outer) + "_K" + std::to_string(s.inner);
}

}  // namespace

void register_grouped_gemm_benchmarks() {
  for (const GroupShape shape : {kIssueShape, kPresetFc2}) {
    for (const auto& [name, dtype] : {std::pair{"fp8_tensor_fast", DType::e4m3},
                                      std::pair{"bf16", DType::bf16}}) {
      for (const auto& [split_name, split] :
           {std::pair{"balanced", Split::balanced}, std::pair{"skewed", Split::skewed}}) {
        const std::string label = std::string("grouped_gemm/") + name + "/" + shape_name(shape) +
                                  "_" + split_name;
        configure(benchmark::RegisterBenchmark(
            label.c_str(),
            [dtype, split, shape](benchmark::State& s) { bm_grouped(s, dtype, split, shape); }));
      }
    }
  }
}

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
