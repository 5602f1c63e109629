// CPU reference of the embedding family. Every sum runs in the documented order, which the CUDA
// backend reproduces: embedding sums row by row in increasing row order (so both backends agree
// bit for bit), cross_entropy in the fixed order of fixed_order_reduce.h over
// kCrossEntropyLanes lanes (so the backends differ only by their expf/logf roundings).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "octet/fp8/format.h"
#include "ops/embedding_backend.h"
#include "ops/fixed_order_reduce.h"

namespace octet::ops::cpu {
namespace {

/// Below this many elements of work a loop runs on one thread: waking an OpenMP team costs more
/// (tens of microseconds, far more on a loaded machine) than the loop.
constexpr int64_t kParallelMinElements = int64_t{1} << 16;

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) { return fp8::decode_bf16(x); }

/// Writes `value` into element i of an f32 or bf16 (round-to-nearest-even) tensor.
inline void store(void* out, bool bf16, int64_t i, float value) {
  if (bf16) {
    static_cast<uint16_t*>(out)[i] = fp8::encode_bf16(value);
  } else {
    static_cast<float*>(out)[i] = value;
  }
}

/// acc[c] += row[c] for c < dim.
template <typename T>
void add_row(float* acc, const T* row, int64_t dim) {
  for (int64_t c = 0; c < dim; ++c) acc[c] += to_float(row[c]);
}

template <typename T>
void embedding_backward_typed(const int32_t* ids, const T* dout, int64_t rows, int64_t dim,
                              int64_t seq, float* dwte, int64_t vocab, float* dwpe) {
  // Stable counting sort of the rows by id: bucket v lists its rows in increasing order.
  std::vector<int64_t> begin(vocab + 1, 0);
  for (int64_t r = 0; r < rows; ++r) ++begin[ids[r] + 1];
  for (int64_t v = 0; v < vocab; ++v) begin[v + 1] += begin[v];
  std::vector<int64_t> order(rows);
  {
    std::vector<int64_t> next(begin.begin(), begin.end() - 1);
    for (int64_t r = 0; r < rows; ++r) order[next[ids[r]]++] = r;
  }

#pragma omp parallel if (rows * dim >= kParallelMinElements)
  {
    std::vector<float> acc(dim);
    // dwte[v] += (((0 + dout[r0]) + dout[r1]) + ...) over v's rows r0 < r1 < ...
#pragma omp for schedule(dynamic, 64)
    for (int64_t v = 0; v < vocab; ++v) {
      if (begin[v] == begin[v + 1]) continue;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = begin[v]; k < begin[v + 1]; ++k)
        add_row(acc.data(), dout + order[k] * dim, dim);
      for (int64_t c = 0; c < dim; ++c) dwte[v * dim + c] += acc[c];
    }
    if (dwpe != nullptr) {
      // dwpe[t] += (((0 + dout[t]) + dout[seq + t]) + ...) over the batch in order.
#pragma omp for schedule(static)
      for (int64_t t = 0; t < seq; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t r = t; r < rows; r += seq) add_row(acc.data(), dout + r * dim, dim);
        for (int64_t c = 0; c < dim; ++c) dwpe[t * dim + c] += acc[c];
      }
    }
  }
}

template <typename T>
void cross_entropy_typed(const T* logits, const int32_t* targets, float* losses, void* dlogits,
                         int64_t rows, int64_t vocab, float grad_scale) {
  constexpr bool kBf16 = sizeof(T) == 2;
#pragma omp parallel for schedule(static) if (rows * vocab >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* l = logits + r * vocab;
    const int32_t target = targets[r];
    if (target < 0) {  // ignored row
      losses[r] = 0.0f;
      if (dlogits != nullptr)
        for (int64_t j = 0; j < vocab; ++j) store(dlogits, kBf16, r * vocab + j, 0.0f);
      continue;
    }
    const float m = fixed_order_reduce<kCrossEntropyLanes, float>(
        vocab, MaxOp{}, [l](int64_t j) { return to_float(l[j]); });
    const float s = fixed_order_reduce<kCrossEntropyLanes, float>(
        vocab, SumOp{}, [l, m](int64_t j) { return std::exp(to_float(l[j]) - m); });
    // The loss reads logits[target] before any gradient is stored (dlogits may alias logits).
    losses[r] = (m + std::log(s)) - to_float(l[target]);
    if (dlogits == nullptr) continue;
    for (int64_t j = 0; j < vocab; ++j) {
      const float p = std::exp(to_float(l[j]) - m) / s;
      store(dlogits, kBf16, r * vocab + j, (j == target ? p - 1.0f : p) * grad_scale);
    }
  }
}

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& wte, const Tensor& wpe, int64_t seq,
                       const Tensor& out) {
  const int32_t* id = ids.data<int32_t>();
  const float* tokens = wte.data<float>();
  const float* positions = wpe.defined() ? wpe.data<float>() : nullptr;
  void* o = out.raw_data();
  const bool bf16 = out.dtype() == DType::bf16;
  const int64_t rows = ids.numel();
  const int64_t dim = wte.size(1);
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const float* w = tokens + static_cast<int64_t>(id[r]) * dim;
    const float* p = positions != nullptr ? positions + (r % seq) * dim : nullptr;
    // Without positions the token row is copied as is (no "+ 0", which would turn -0 into +0).
    for (int64_t c = 0; c < dim; ++c) store(o, bf16, r * dim + c, p ? w[c] + p[c] : w[c]);
  }
}

void embedding_backward(const Tensor& ids, const Tensor& dout, int64_t seq, const Tensor& dwte,
                        const Tensor& dwpe) {
  const int64_t rows = ids.numel();
  const int64_t dim = dwte.size(1);
  float* dwpe_data = dwpe.defined() ? dwpe.data<float>() : nullptr;
  if (dout.dtype() == DType::bf16) {
    embedding_backward_typed(ids.data<int32_t>(), static_cast<const uint16_t*>(dout.raw_data()),
                             rows, dim, seq, dwte.data<float>(), dwte.size(0), dwpe_data);
  } else {
    embedding_backward_typed(ids.data<int32_t>(), dout.data<float>(), rows, dim, seq,
                             dwte.data<float>(), dwte.size(0), dwpe_data);
  }
}

void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                   const Tensor& dlogits, float grad_scale) {
  void* d = dlogits.defined() ? dlogits.raw_data() : nullptr;
  if (logits.dtype() == DType::bf16) {
    cross_entropy_typed(static_cast<const uint16_t*>(logits.raw_data()), targets.data<int32_t>(),
                        losses.data<float>(), d, logits.rows(), logits.cols(), grad_scale);
  } else {
    cross_entropy_typed(logits.data<float>(), targets.data<int32_t>(), losses.data<float>(), d,
                        logits.rows(), logits.cols(), grad_scale);
  }
}

}  // namespace octet::ops::cpu
