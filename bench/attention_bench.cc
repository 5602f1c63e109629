// Causal attention, bf16, forward and backward, at GPT-2 training shapes, for every tiling of the
// tensor-core kernels (src/ops/cuda/attention_tiling.h), so that one run compares them.
//
// FLOPs count the causal half only (tiles above the diagonal are skipped):
// - forward: 2 GEMMs (Q K^T, P V) of 2*B*H*T^2*D/2 each = 4*B*H*T^2*D/2;
// - backward: FlashAttention-2's convention of 5 such GEMMs (S, dP, dV, dK, dQ) =
//   10*B*H*T^2*D/2, although octet's kernels run 7 (S and dP twice, so that no float atomics
//   sum dQ); the delta kernel (rowsum(dO * O)) is included in the time.
// The ceiling ratio is 0: there is no vendor attention in this process to compare with.
#include "bench_util.h"

#if OCTET_WITH_CUDA

#include <string>

#include "octet/ops/attention.h"
#include "ops/cuda/attention_tiling.h"

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
constexpr ops::cuda::AttentionTiling kTilings[] = {
    ops::cuda::AttentionTiling::kRows16,
    ops::cuda::AttentionTiling::kRows32,
    ops::cuda::AttentionTiling::kRows32Dkdv,
};
/// Causal-half GEMMs counted per pass (see the file comment).
constexpr double kForwardGemms = 2;
constexpr double kBackwardGemms = 5;

double causal_gemm_flops(const ops::AttentionShape& s) {
  return 2.0 * s.batch * s.heads * static_cast<double>(s.seq) * s.seq * s.head_dim / 2;
}

void bm_attention(benchmark::State& state, const ops::AttentionShape& s,
                  ops::cuda::AttentionTiling tiling, bool backward) {
  guarded(state, [&] {
    const int64_t tokens = s.batch * s.seq, width = s.heads * s.head_dim;
    // Uniform [-1, 1] inputs: scaled scores have a standard deviation near 1/3, a softmax far
    // from one-hot, so every tile does the full work.
    const Tensor qkv = random_tensor({tokens, 3 * width}, DType::bf16, /*slot=*/0);
    const Tensor dout = random_tensor({tokens, width}, DType::bf16, /*slot=*/1);
    const Tensor out = Tensor::empty({tokens, width}, DType::bf16, device());
    const Tensor lse = Tensor::empty({s.batch, s.heads, s.seq}, DType::f32, device());
    const Tensor dqkv = Tensor::empty({tokens, 3 * width}, DType::bf16, device());
    ops::cuda::attention_forward_tiled(qkv, s, out, lse, tiling);
    double seconds = 0;
    if (backward) {
      seconds = time_loop(state, [&] {
        ops::cuda::attention_backward_tiled(dout, qkv, out, lse, s, dqkv, tiling);
      });
    } else {
      seconds = time_loop(state, [&] { ops::cuda::attention_forward_tiled(qkv, s, out, lse, tiling); });
    }
    const double gemms = backward ? kBackwardGemms : kForwardGemms;
    report_gemm(state, seconds, gemms * causal_gemm_flops(s), /*ceiling_seconds=*/0);
    state.SetLabel(std::string(backward ? "5 causal GEMMs (FA2 convention)" : "2 causal GEMMs") +
                   (tiling == ops::cuda::default_attention_tiling(s.head_dim) ? "; default" : ""));
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
      for (ops::cuda::AttentionTiling tiling : kTilings) {
        // kRows32Dkdv differs from kRows32 in the dK/dV kernel only.
        if (!backward && tiling == ops::cuda::AttentionTiling::kRows32Dkdv) continue;
        const std::string name = std::string("attention/") + (backward ? "backward/" : "forward/") +
                                 ops::cuda::attention_tiling_name(tiling) + "/" + shape;
        configure(benchmark::RegisterBenchmark(
            name.c_str(),
            [s, tiling, backward](benchmark::State& st) { bm_attention(st, s, tiling, backward); }));
      }
    }
  }
}

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
