// Causal attention, bf16, forward and backward, at GPT-2 training shapes, for every tiling of the
// tensor-core kernels (attention_tilings.h), so that one run compares them, and for the cuDNN path
// (OCTET_ATTENTION=cudnn: cuDNN's fused SDPA, src/ops/cuda/attention_cudnn.cc) beside them; at
// long context (T=4096) only the default tiling and cuDNN run. A tiling that ops::attention_* do
// not use (attention_tilings.cu) is first checked against the library's results, and its
// benchmark fails when they differ by more than the parity suite's bf16 bounds; the cuDNN path is
// checked the same way against the flash path, at twice those bounds (two independent errors).
// bench/peers/attention_torch.py measures PyTorch's SDPA backends at the same shapes and counts.
//
// FLOPs count the causal half only (tiles above the diagonal are skipped):
// - forward: 2 GEMMs (Q K^T, P V) of 2*B*H*T^2*D/2 each = 4*B*H*T^2*D/2;
// - backward: FlashAttention-2's convention of 5 such GEMMs (S, dP, dV, dK, dQ) =
//   10*B*H*T^2*D/2, although octet's kernels run 7 (S and dP twice, so that no float atomics
//   sum dQ); the delta kernel (rowsum(dO * O)) is included in the time. The cuDNN rows count
//   the same, whatever cuDNN runs, and time the whole ops::attention_* call.
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
/// And the same heads at long context: 8192 tokens as batch 2 of 4096, default tiling only.
struct AttentionCase {
  const char* model;
  ops::AttentionShape shape;
  bool every_tiling;
};
constexpr AttentionCase kCases[] = {
    {"gpt2_1.5b", {8, 1024, 25, 64}, true},
    {"gpt2_124m", {8, 1024, 12, 64}, true},
    {"gpt2_1.5b", {2, 4096, 25, 64}, false},
    {"gpt2_124m", {2, 4096, 12, 64}, false},
};
constexpr AttentionTiling kTilings[] = {
    AttentionTiling::kRows16,
    AttentionTiling::kRows32,
    AttentionTiling::kRows32Dkdv,
};
/// Causal-half GEMMs counted per pass (see the file comment).
constexpr double kForwardGemms = 2;
constexpr double kBackwardGemms = 5;
/// RoPE's base: the cost does not depend on it.
constexpr float kRopeTheta = 10000.0f;

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
  const auto* bits = static_cast<const uint16_t*>(host.raw_data());  // bf16 bits
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

/// One benchmark's inputs (qkv, dout) and outputs (out, lse, dqkv) on the device.
struct AttentionTensors {
  Tensor qkv, dout, out, lse, dqkv;
};
AttentionTensors attention_tensors(const ops::AttentionShape& s) {
  const int64_t tokens = s.batch * s.seq, width = s.heads * s.head_dim;
  AttentionTensors t;
  // Uniform [-1, 1] inputs: scaled scores have a standard deviation near 1/3, a softmax far
  // from one-hot, so every tile does the full work.
  t.qkv = random_tensor({tokens, 3 * width}, DType::bf16, /*slot=*/0);
  t.dout = random_tensor({tokens, width}, DType::bf16, /*slot=*/1);
  t.out = Tensor::empty({tokens, width}, DType::bf16, device());
  t.lse = Tensor::empty({s.batch, s.heads, s.seq}, DType::f32, device());
  t.dqkv = Tensor::empty({tokens, 3 * width}, DType::bf16, device());
  return t;
}

void bm_attention(benchmark::State& state, const ops::AttentionShape& s, AttentionTiling tiling,
                  bool backward) {
  guarded(state, [&] {
    const AttentionTensors tensors = attention_tensors(s);
    const Tensor &qkv = tensors.qkv, &dout = tensors.dout, &out = tensors.out, &lse = tensors.lse,
                 &dqkv = tensors.dqkv;
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

/// The cuDNN path through ops::attention_*, checked once against the flash path's results.
void bm_attention_cudnn(benchmark::State& state, const ops::AttentionShape& s, bool backward) {
  guarded(state, [&] {
    if (!ops::cudnn_attention_built()) {
      throw Unsupported(
          "built without the cuDNN attention path (OCTET_WITH_CUDNN_ATTENTION; "
          "scripts/cudnn-frontend.sh fetches what it needs)");
    }
    const AttentionTensors tensors = attention_tensors(s);
    const Tensor &qkv = tensors.qkv, &dout = tensors.dout, &out = tensors.out, &lse = tensors.lse,
                 &dqkv = tensors.dqkv;
    const AttentionTensors flash = attention_tensors(s);  // its outputs (inputs: the same pools)
    {
      const ops::ScopedAttentionChoice choice(ops::AttentionChoice::flash);
      ops::attention_forward(qkv, s, flash.out, flash.lse);
      if (backward) ops::attention_backward(dout, qkv, flash.out, flash.lse, s, flash.dqkv);
    }
    const ops::ScopedAttentionChoice cudnn(ops::AttentionChoice::cudnn);
    OCTET_CHECK(ops::attention_path(qkv, s) == ops::AttentionPath::cudnn,
                "attention cudnn bench: the shape does not take the cuDNN path");
    // The first calls also build cuDNN's graphs (cached per shape), outside the timing.
    ops::attention_forward(qkv, s, out, lse);
    constexpr double kPaths = 2;  // cuDNN's error and flash's, each within the bound
    expect_close("cudnn out", out, flash.out, kPaths * kOutTolerance);
    expect_close("cudnn lse", lse, flash.lse, kPaths * kLseTolerance);
    if (backward) {
      ops::attention_backward(dout, qkv, out, lse, s, dqkv);
      expect_close("cudnn dqkv", dqkv, flash.dqkv, kPaths * kGradTolerance);
    }
    double seconds = 0;
    if (backward) {
      seconds = time_loop(state, [&] { ops::attention_backward(dout, qkv, out, lse, s, dqkv); });
    } else {
      seconds = time_loop(state, [&] { ops::attention_forward(qkv, s, out, lse); });
    }
    const double gemms = backward ? kBackwardGemms : kForwardGemms;
    report_gemm(state, seconds, gemms * causal_gemm_flops(s), /*ceiling_seconds=*/0);
    state.SetLabel(backward ? "5 causal GEMMs (FA2 convention); cuDNN, deterministic"
                            : "2 causal GEMMs; cuDNN");
  });
}

/// RoPE on q and k of a packed bf16 qkv, in place (ops::rope), against a copy of the bytes it
/// moves: q and k read once and written once (v is not touched).
void bm_rope(benchmark::State& state, const ops::AttentionShape& s) {
  guarded(state, [&] {
    copy_bandwidth();
    Tensor qkv = random_tensor({s.batch * s.seq, 3 * s.heads * s.head_dim}, DType::bf16, 1);
    const double seconds = time_loop(state, [&] { ops::rope(qkv, s, kRopeTheta, false); });
    const double bytes = 2.0 * 2 * s.batch * s.seq * s.heads * s.head_dim * 2;
    report_memory(state, seconds, bytes, bytes + 8.0 * s.seq * s.head_dim / 2);
    state.SetLabel("q and k rotated in place (plus the angle table), vs D2D copy");
  });
}

}  // namespace

void register_attention_benchmarks() {
  // Llama-style shapes: llama-1b's and moe-16x2048's 16 heads of 128 (32 x 1024 tokens), and
  // GPT-2 1.5B's heads (rope is on for Llama-style models only, but the kernel takes any).
  for (const ops::AttentionShape s :
       {ops::AttentionShape{32, 1024, 16, 128}, ops::AttentionShape{8, 1024, 25, 64}}) {
    const std::string name = "attention/rope/B" + std::to_string(s.batch) + "_T" +
                             std::to_string(s.seq) + "_H" + std::to_string(s.heads) + "_D" +
                             std::to_string(s.head_dim);
    configure(
        benchmark::RegisterBenchmark(name.c_str(), [s](benchmark::State& st) { bm_rope(st, s); }));
  }
  for (const AttentionCase& c : kCases) {
    const ops::AttentionShape s = c.shape;
    const std::string shape = std::string(c.model) + "/B" + std::to_string(s.batch) + "_T" +
                              std::to_string(s.seq) + "_H" + std::to_string(s.heads) + "_D" +
                              std::to_string(s.head_dim);
    for (bool backward : {false, true}) {
      const std::string pass = backward ? "backward/" : "forward/";
      for (AttentionTiling tiling : kTilings) {
        // kRows32Dkdv differs from kRows32 in the dK/dV kernel only.
        if (!backward && tiling == AttentionTiling::kRows32Dkdv) continue;
        if (!c.every_tiling && tiling != default_attention_tiling(s.head_dim)) continue;
        const std::string name = "attention/" + pass + attention_tiling_name(tiling) + "/" + shape;
        configure(
            benchmark::RegisterBenchmark(name.c_str(), [s, tiling, backward](benchmark::State& st) {
              bm_attention(st, s, tiling, backward);
            }));
      }
      const std::string name = "attention/" + pass + "cudnn/" + shape;
      configure(benchmark::RegisterBenchmark(name.c_str(), [s, backward](benchmark::State& st) {
        bm_attention_cudnn(st, s, backward);
      }));
    }
  }
}

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
