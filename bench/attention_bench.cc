// Causal attention, bf16, forward and backward, at GPT-2 training shapes, for every tiling of the
// tensor-core kernels (attention_tilings.h), so that one run compares them. A tiling that
// ops::attention_* do not use (attention_tilings.cu) is first checked against the library's
// results, and its benchmark fails when they differ by more than the parity suite's bf16 bounds.
//
// FLOPs count the causal half only (tiles above the diagonal are skipped):
// - forward: 2 GEMMs (Q K^T, P V) of 2*B*H*T^2*D/2 each = 4*B*H*T^2*D/2;
// - backward: FlashAttention-2's convention of 5 such GEMMs (S, dP, dV, dK, dQ) =
//   10*B*H*T^2*D/2, although octet's kernels run 7 (S and dP twice, so that no float atomics
//   sum dQ); the delta kernel (rowsum(dO * O)) is included in the time.
// The ceiling ratio is 0: there is no vendor attention in this process to compare with.
#include "bench_util.h"

#if OCTET_WITH_CUDA

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attention_tilings.h"
#include "octet/fp8/format.h"
#include "octet/ops/attention.h"

namespace octet::bench {
namespace {

/// GPT-2 training shapes: batch 8, sequence 1024, head_dim 64; 25 heads (1.5B) and 12 (124M).
struct AttentionCase {
  const char* model;
  ops::AttentionShape shape;
};
constexpr AttentionCase kCases[] = {
    {"gpt2_1.5b", {8, 1024, 25, 64}},
    {"gpt2_124m", {8, 1024, 12, 64}},
};
constexpr AttentionTiling kTilings[] = {
    AttentionTiling::kRows16,
    AttentionTiling::kRows32,
    AttentionTiling::kRows32Dkdv,
};
/// Causal-half GEMMs counted per pass (see the file comment).
constexpr double kForwardGemms = 2;
constexpr double kBackwardGemms = 5;

/// Relative L2 bounds of a tiling's results against the library's: the bf16 bounds of
/// tests/ops/attention_test.cc, which holds the library's results to a double-precision reference.
constexpr double kOutTolerance = 1e-2;
constexpr double kLseTolerance = 1e-5;
constexpr double kGradTolerance = 1e-2;

double causal_gemm_flops(const ops::AttentionShape& s) {
  return 2.0 * s.batch * s.heads * static_cast<double>(s.seq) * s.seq * s.head_dim / 2;
}

/// The values of an f32 or bf16 tensor, on the host.
std::vector<float> host_floats(const Tensor& t) {
  if (t.dtype() == DType::f32) return host_values_f32(t);
  const Tensor host = t.to(Device::cpu());
  const uint16_t* bits = host.data<uint16_t>();
  std::vector<float> values(host.numel());
  for (int64_t i = 0; i < host.numel(); ++i) values[i] = fp8::decode_bf16(bits[i]);
  return values;
}

/// Throws unless ||got - want|| / ||want|| <= bound, over columns [c0, c1) of the two tensors
/// seen as [dim 0, the rest] (c1 < 0: to the last column).
void expect_close(const char* what, const Tensor& got, const Tensor& want, double bound,
                  int64_t c0 = 0, int64_t c1 = -1) {
  const std::vector<float> g = host_floats(got), w = host_floats(want);
  const int64_t rows = want.shape()[0], cols = want.numel() / rows;
  if (c1 < 0) c1 = cols;
  double diff = 0, norm = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      const double d = static_cast<double>(g[r * cols + c]) - w[r * cols + c];
      diff += d * d;
      norm += static_cast<double>(w[r * cols + c]) * w[r * cols + c];
    }
  }
  const double error = std::sqrt(diff / norm);
  OCTET_CHECK(error <= bound, "attention tiling check: ", what, " is ", error,
              " from the library's (relative L2), more than ", bound);
}

/// The reference check of a tiling the library does not use: its forward (out, lse given) and,
/// for a backward benchmark, its dq, dk and dv against ops::attention_*.
void check_tiling(const Tensor& qkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                  const ops::AttentionShape& s, AttentionTiling tiling, bool backward) {
  const Tensor want_out = Tensor::empty(out.shape(), DType::bf16, device());
  const Tensor want_lse = Tensor::empty(lse.shape(), DType::f32, device());
  ops::attention_forward(qkv, s, want_out, want_lse);
  expect_close("out", out, want_out, kOutTolerance);
  expect_close("lse", lse, want_lse, kLseTolerance);
  if (!backward) return;
  const Tensor dqkv = Tensor::empty(qkv.shape(), DType::bf16, device());
  const Tensor want_dqkv = Tensor::empty(qkv.shape(), DType::bf16, device());
  attention_backward_tiled(dout, qkv, out, lse, s, dqkv, tiling);
  ops::attention_backward(dout, qkv, want_out, want_lse, s, want_dqkv);
  const int64_t width = s.heads * s.head_dim;
  const char* parts[] = {"dq", "dk", "dv"};
  for (int64_t p = 0; p < 3; ++p) {
    expect_close(parts[p], dqkv, want_dqkv, kGradTolerance, p * width, (p + 1) * width);
  }
}

void bm_attention(benchmark::State& state, const ops::AttentionShape& s, AttentionTiling tiling,
                  bool backward) {
  guarded(state, [&] {
    const int64_t tokens = s.batch * s.seq, width = s.heads * s.head_dim;
    // Uniform [-1, 1] inputs: scaled scores have a standard deviation near 1/3, a softmax far
    // from one-hot, so every tile does the full work.
    const Tensor qkv = random_tensor({tokens, 3 * width}, DType::bf16, /*slot=*/0);
    const Tensor dout = random_tensor({tokens, width}, DType::bf16, /*slot=*/1);
    const Tensor out = Tensor::empty({tokens, width}, DType::bf16, device());
    const Tensor lse = Tensor::empty({s.batch, s.heads, s.seq}, DType::f32, device());
    const Tensor dqkv = Tensor::empty({tokens, 3 * width}, DType::bf16, device());
    attention_forward_tiled(qkv, s, out, lse, tiling);
    if (tiling != default_attention_tiling(s.head_dim)) {
      check_tiling(qkv, dout, out, lse, s, tiling, backward);
    }
    double seconds = 0;
    if (backward) {
      seconds =
          time_loop(state, [&] { attention_backward_tiled(dout, qkv, out, lse, s, dqkv, tiling); });
    } else {
      seconds = time_loop(state, [&] { attention_forward_tiled(qkv, s, out, lse, tiling); });
    }
    const double gemms = backward ? kBackwardGemms : kForwardGemms;
    report_gemm(state, seconds, gemms * causal_gemm_flops(s), /*ceiling_seconds=*/0);
    state.SetLabel(std::string(backward ? "5 causal GEMMs (FA2 convention)" : "2 causal GEMMs") +
                   (tiling == default_attention_tiling(s.head_dim) ? "; default" : ""));
  });
}

}  // namespace

void register_attention_benchmarks() {
  for (const AttentionCase& c : kCases) {
    const ops::AttentionShape s = c.shape;
    const std::string shape = std::string(c.model) + "/B" + std::to_string(s.batch) + "_T" +
                              std::to_string(s.seq) + "_H" + std::to_string(s.heads) + "_D" +
                              std::to_string(s.head_dim);
    for (bool backward : {false, true}) {
      for (AttentionTiling tiling : kTilings) {
        // kRows32Dkdv differs from kRows32 in the dK/dV kernel only.
        if (!backward && tiling == AttentionTiling::kRows32Dkdv) continue;
        const std::string name = std::string("attention/") + (backward ? "backward/" : "forward/") +
                                 attention_tiling_name(tiling) + "/" + shape;
        configure(benchmark::RegisterBenchmark(
            name.c_str(),
            [s, tiling, backward](benchmark::State& st) { bm_attention(st, s, tiling, backward); }));
      }
    }
  }
}

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
