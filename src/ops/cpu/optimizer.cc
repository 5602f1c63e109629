// CPU reference of the optimizer family. global_norm_squared follows the fixed order of
// optimizer_backend.h and adamw_step runs optimizer_math.h's scalar step on every element of every
// tensor, so the CUDA backend reproduces both bit for bit.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/fixed_order_reduce.h"
#include "ops/optimizer_backend.h"

namespace octet::ops::cpu {
namespace {

/// Below this many elements of work a loop runs on one thread: waking an OpenMP team costs more
/// (tens of microseconds, far more on a loaded machine) than the loop.
constexpr int64_t kParallelMinElements = int64_t{1} << 16;

}  // namespace

void tensor_norm_sums(const Tensor* grads, int count, const Tensor& sums) {
  // All chunks of all tensors in one parallel loop (one OpenMP region per call, not per tensor).
  std::vector<int64_t> first_chunk(count + 1, 0);
  for (int i = 0; i < count; ++i)
    first_chunk[i + 1] = first_chunk[i] + (grads[i].numel() + kNormChunk - 1) / kNormChunk;
  const int64_t chunks = first_chunk[count];
  std::vector<double> partials(static_cast<size_t>(chunks));
#pragma omp parallel for schedule(static) if (chunks * kNormChunk >= kParallelMinElements)
  for (int64_t global = 0; global < chunks; ++global) {
    const int i = static_cast<int>(
        std::upper_bound(first_chunk.begin(), first_chunk.end(), global) - first_chunk.begin() - 1);
    const int64_t begin = (global - first_chunk[i]) * kNormChunk;
    const float* x = grads[i].data<float>() + begin;
    partials[global] = fixed_order_reduce<kNormLanes, double>(
        std::min(kNormChunk, grads[i].numel() - begin), SumOp{}, [x](int64_t j) {
          const double value = x[j];
          return value * value;
        });
  }
  auto* out = static_cast<double*>(sums.raw_data());
  for (int i = 0; i < count; ++i) {
    const double* own = partials.data() + first_chunk[i];
    out[i] = fixed_order_reduce<kNormLanes, double>(first_chunk[i + 1] - first_chunk[i], SumOp{},
                                                    [own](int64_t j) { return own[j]; });
  }
}

void sum_tensor_norms(const Tensor& sums, const Tensor& norm_sq) {
  const auto* in = static_cast<const double*>(sums.raw_data());
  double total = 0.0;
  for (int64_t i = 0; i < sums.numel(); ++i) total += in[i];
  norm_sq.data<float>()[0] = static_cast<float>(total);
}

void adamw_step(const AdamWTensor* tensors, int count, const Tensor& norm_sq,
                const AdamWCoefficients& coefficients) {
  // All chunks of all tensors in one parallel loop, as global_norm_squared does: the many small
  // tensors (biases, norm gains) then neither wake a team each nor leave threads idle.
  std::vector<int64_t> first_chunk(count + 1, 0);
  int64_t elements = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t n = tensors[i].param.numel();
    first_chunk[i + 1] = first_chunk[i] + (n + kAdamWChunk - 1) / kAdamWChunk;
    elements += n;
  }
  const int64_t chunks = first_chunk[count];
  const float clip = adamw_clip_factor(norm_sq.data<float>()[0], coefficients.max_grad_norm);
#pragma omp parallel for schedule(static) if (elements >= kParallelMinElements)
  for (int64_t global = 0; global < chunks; ++global) {
    const int i = static_cast<int>(
        std::upper_bound(first_chunk.begin(), first_chunk.end(), global) - first_chunk.begin() - 1);
    const AdamWTensor& t = tensors[i];
    const int64_t begin = (global - first_chunk[i]) * kAdamWChunk;
    const int64_t end = std::min(begin + kAdamWChunk, t.param.numel());
    float* p = t.param.data<float>();
    const float* g = t.grad.data<float>();
    float* ms = t.m.data<float>();
    float* vs = t.v.data<float>();
    for (int64_t j = begin; j < end; ++j)
      adamw_update(p[j], g[j], ms[j], vs[j], coefficients, t.weight_decay, clip);
  }
}

}  // namespace octet::ops::cpu
