// CPU reference of causal attention and RoPE: plain loops with OpenMP, all math in f32, every sum
// in a fixed sequential order (so the results do not depend on the thread count). Each output row
// has one owner: dq sums over keys, dk and dv over queries, as the CUDA kernels do; the backward
// recomputes the probabilities from the forward's lse once per (batch, head) and block of query
// rows, and both of its passes read them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "octet/fp8/format.h"
#include "ops/attention_backend.h"

namespace octet::ops::cpu {
namespace {

/// Index arithmetic of the packed layouts: qkv [B*T, 3*H*D] = [q | k | v] per token, out and dout
/// [B*T, H*D], lse and the backward's row statistics [B, H, T].
struct Layout {
  explicit Layout(const AttentionShape& s)
      : seq(s.seq),
        heads(s.heads),
        head_dim(s.head_dim),
        qkv_row(3 * s.heads * s.head_dim),
        out_row(s.heads * s.head_dim) {}
  int64_t q(int64_t b, int64_t t, int64_t h) const {
    return (b * seq + t) * qkv_row + h * head_dim;
  }
  int64_t k(int64_t b, int64_t t, int64_t h) const { return q(b, t, h) + heads * head_dim; }
  int64_t v(int64_t b, int64_t t, int64_t h) const { return q(b, t, h) + 2 * heads * head_dim; }
  int64_t o(int64_t b, int64_t t, int64_t h) const {
    return (b * seq + t) * out_row + h * head_dim;
  }
  int64_t stat(int64_t b, int64_t h, int64_t t) const { return (b * heads + h) * seq + t; }

  int64_t seq, heads, head_dim, qkv_row, out_row;
};

/// The values of a f32 or bf16 tensor as f32: the tensor's own memory for f32, a decoded copy for
/// bf16.
class F32Values {
 public:
  explicit F32Values(const Tensor& t) {
    if (t.dtype() == DType::f32) {
      data_ = t.data<float>();
      return;
    }
    const auto* bits = static_cast<const uint16_t*>(t.raw_data());
    copy_.resize(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < copy_.size(); ++i) copy_[i] = fp8::decode_bf16(bits[i]);
    data_ = copy_.data();
  }
  const float* data() const { return data_; }

 private:
  std::vector<float> copy_;
  const float* data_ = nullptr;
};

/// Writes f32 `values` into `t` (f32, or bf16 rounded to nearest even).
void store(const std::vector<float>& values, const Tensor& t) {
  if (t.dtype() == DType::f32) {
    float* dst = t.data<float>();
    for (size_t i = 0; i < values.size(); ++i) dst[i] = values[i];
    return;
  }
  auto* dst = static_cast<uint16_t*>(t.raw_data());
  for (size_t i = 0; i < values.size(); ++i) dst[i] = fp8::encode_bf16(values[i]);
}

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

/// dot(a, rows[r], n) for kDots rows at once. Each sum still runs over the elements in order, so
/// every result has dot()'s bits; the independent chains only overlap in the pipeline.
constexpr int kDots = 4;
void dots(const float* a, const float* const rows[kDots], int64_t n, float out[kDots]) {
  float sum[kDots] = {};
  for (int64_t i = 0; i < n; ++i) {
    for (int r = 0; r < kDots; ++r) sum[r] += a[i] * rows[r][i];
  }
  for (int r = 0; r < kDots; ++r) out[r] = sum[r];
}

/// out[j] = dot(a, row(j), n) for j in [0, count): kDots at a time, then one by one.
template <typename Row>
void dots_over(const float* a, Row row, int64_t count, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + kDots <= count; j += kDots) {
    const float* rows[kDots];
    for (int r = 0; r < kDots; ++r) rows[r] = row(j + r);
    dots(a, rows, n, out + j);
  }
  for (; j < count; ++j) out[j] = dot(a, row(j), n);
}

float softmax_scale(const AttentionShape& s) {
  return 1.0f / std::sqrt(static_cast<float>(s.head_dim));
}

/// OpenMP chunk of rows: causal rows differ in cost, so they are handed out dynamically.
constexpr int kRowsPerChunk = 8;
/// Query rows whose probabilities the backward keeps at once (two kRowBlock x seq f32 buffers a
/// thread).
constexpr int64_t kRowBlock = 64;

}  // namespace

void attention_forward(const Tensor& qkv, const AttentionShape& shape, const Tensor& out,
                       const Tensor& lse) {
  const Layout at(shape);
  const int64_t B = shape.batch, T = shape.seq, H = shape.heads, D = shape.head_dim;
  const float scale = softmax_scale(shape);
  const F32Values x(qkv);
  const float* in = x.data();
  std::vector<float> o(static_cast<size_t>(B * T * H * D));
  float* lse_out = lse.data<float>();

#pragma omp parallel
  {
    std::vector<float> scores(static_cast<size_t>(T));
#pragma omp for schedule(dynamic, kRowsPerChunk)
    for (int64_t row = 0; row < B * H * T; ++row) {
      const int64_t b = row / (H * T), h = row / T % H, i = row % T;
      const float* q = in + at.q(b, i, h);
      dots_over(q, [&](int64_t j) { return in + at.k(b, j, h); }, i + 1, D, scores.data());
      float max_score = -INFINITY;
      for (int64_t j = 0; j <= i; ++j) {
        scores[j] *= scale;
        max_score = std::fmax(max_score, scores[j]);
      }
      float sum = 0.0f;
      float* acc = o.data() + at.o(b, i, h);
      for (int64_t j = 0; j <= i; ++j) {
        const float p = std::exp(scores[j] - max_score);
        sum += p;
        const float* v = in + at.v(b, j, h);
        for (int64_t d = 0; d < D; ++d) acc[d] += p * v[d];
      }
      for (int64_t d = 0; d < D; ++d) acc[d] /= sum;
      lse_out[at.stat(b, h, i)] = max_score + std::log(sum);
    }
  }
  store(o, out);
}

void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                        const AttentionShape& shape, const Tensor& dqkv) {
  const Layout at(shape);
  const int64_t B = shape.batch, T = shape.seq, H = shape.heads, D = shape.head_dim;
  const float scale = softmax_scale(shape);
  const F32Values x_values(qkv), o_values(out), g_values(dout);
  const float* x = x_values.data();
  const float* o = o_values.data();
  const float* g = g_values.data();
  const float* lse_in = lse.data<float>();
  std::vector<float> dx(static_cast<size_t>(B * T * 3 * H * D));

  // delta_i = dout_i . out_i = sum_j P_ij dP_ij, the softmax backward's row term.
  std::vector<float> delta(static_cast<size_t>(B * H * T));
#pragma omp parallel for
  for (int64_t row = 0; row < B * H * T; ++row) {
    const int64_t b = row / (H * T), h = row / T % H, i = row % T;
    delta[row] = dot(g + at.o(b, i, h), o + at.o(b, i, h), D);
  }

  // Per (batch, head), a block of query rows at a time: P_ij = exp(s_ij - lse_i) and dS_ij =
  // P_ij (dP_ij - delta_i), dP_ij = dout_i . v_j, for every key j <= i, computed once and read by
  // both passes below. dq_i = scale * sum_{j <= i} dS_ij k_j is complete within the block;
  // dk_j = scale * sum_{i >= j} dS_ij q_i and dv_j = sum_{i >= j} P_ij dout_i add the blocks in
  // ascending order, so every sum runs over its index in order, whatever the block size.
#pragma omp parallel
  {
    std::vector<float> p_block(static_cast<size_t>(kRowBlock * T));
    std::vector<float> ds_block(static_cast<size_t>(kRowBlock * T));
    std::vector<float> dp(static_cast<size_t>(T));
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const auto key = [&](int64_t j) { return x + at.k(b, j, h); };
      const auto value = [&](int64_t j) { return x + at.v(b, j, h); };
      for (int64_t i0 = 0; i0 < T; i0 += kRowBlock) {
        const int64_t i1 = std::min(T, i0 + kRowBlock);
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t r = at.stat(b, h, i);
          float* p = p_block.data() + (i - i0) * T;
          float* ds = ds_block.data() + (i - i0) * T;
          dots_over(x + at.q(b, i, h), key, i + 1, D, p);
          dots_over(g + at.o(b, i, h), value, i + 1, D, dp.data());
          for (int64_t j = 0; j <= i; ++j) {
            p[j] = std::exp(p[j] * scale - lse_in[r]);
            ds[j] = p[j] * (dp[j] - delta[r]);
          }
          float* dq = dx.data() + at.q(b, i, h);
          for (int64_t j = 0; j <= i; ++j) {
            const float* k = key(j);
            for (int64_t d = 0; d < D; ++d) dq[d] += ds[j] * k[d];
          }
          for (int64_t d = 0; d < D; ++d) dq[d] *= scale;
        }
        for (int64_t j = 0; j < i1; ++j) {
          float* dk = dx.data() + at.k(b, j, h);
          float* dv = dx.data() + at.v(b, j, h);
          for (int64_t i = std::max(j, i0); i < i1; ++i) {
            const float dsij = ds_block[(i - i0) * T + j];
            const float pij = p_block[(i - i0) * T + j];
            const float* q = x + at.q(b, i, h);
            const float* gi = g + at.o(b, i, h);
            for (int64_t d = 0; d < D; ++d) {
              dk[d] += dsij * q[d];
              dv[d] += pij * gi[d];
            }
          }
        }
      }
      for (int64_t j = 0; j < T; ++j) {
        float* dk = dx.data() + at.k(b, j, h);
        for (int64_t d = 0; d < D; ++d) dk[d] *= scale;
      }
    }
  }
  store(dx, dqkv);
}

void rope(const Tensor& qkv, const AttentionShape& shape, float theta, bool inverse) {
  const Layout at(shape);
  const int64_t B = shape.batch, T = shape.seq, H = shape.heads, D = shape.head_dim;
  const bool bf16 = qkv.dtype() == DType::bf16;
  float* f32 = bf16 ? nullptr : qkv.data<float>();
  auto* bits = bf16 ? static_cast<uint16_t*>(qkv.raw_data()) : nullptr;
  const auto load = [&](int64_t i) { return bf16 ? fp8::decode_bf16(bits[i]) : f32[i]; };
  const auto put = [&](int64_t i, float v) {
    if (bf16) {
      bits[i] = fp8::encode_bf16(v);
    } else {
      f32[i] = v;
    }
  };

#pragma omp parallel for
  for (int64_t token = 0; token < B * T; ++token) {
    const int64_t b = token / T, t = token % T;
    for (int64_t i = 0; i < D / 2; ++i) {
      // The contract's f32 expression, written identically in the CUDA kernel.
      const float angle = static_cast<float>(t) *
                          std::pow(theta, -2.0f * static_cast<float>(i) / static_cast<float>(D));
      const float c = std::cos(angle);
      const float s = inverse ? -std::sin(angle) : std::sin(angle);
      for (int64_t h = 0; h < H; ++h) {
        for (const int64_t base : {at.q(b, t, h), at.k(b, t, h)}) {
          const int64_t e = base + 2 * i;
          const float x0 = load(e), x1 = load(e + 1);
          put(e, x0 * c - x1 * s);
          put(e + 1, x0 * s + x1 * c);
        }
      }
    }
  }
}

}  // namespace octet::ops::cpu
