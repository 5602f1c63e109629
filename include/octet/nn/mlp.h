// The dense MLP of a transformer block, and the names of a block's Linear layers. The code lives
// in src/nn/transformer.cc with the other block modules.
#pragma once

#include <cstdint>
#include <functional>

#include "octet/core/tensor.h"
#include "octet/nn/block_config.h"
#include "octet/nn/linear.h"
#include "octet/ops/activation.h"

namespace octet::nn {

/// The four Linear layers of a block, in registration order.
enum class LinearSlot : uint8_t { qkv = 0, proj = 1, fc1 = 2, fc2 = 3 };
inline constexpr int kBlockLinears = 4;

/// Called during a training forward (ForwardMode::normal, not recompute or inference) with the
/// input of each Linear of a block and the Saved that Linear just filled (e.g. to measure FP8
/// quantization statistics).
using LinearObserver =
    std::function<void(LinearSlot slot, const Tensor& input, const Linear::Saved& saved)>;

/// MLP: fc1 = Linear(dim, ffn) then GELU (or Linear(dim, 2 ffn) then SwiGLU), fc2 = Linear(ffn,
/// dim).
class MLP {
 public:
  struct Saved {
    Linear::Saved fc1;
    Tensor hidden;  ///< fc1's output: the activation's input
    Linear::Saved fc2;
  };

  MLP(const BlockConfig& config, const Device& device, uint64_t seed, DType compute_dtype);

  /// y [rows, dim] from x [rows, dim], plus `residual` (optional, like y) added in fc2's GEMM
  /// epilogue; recompute as Attention::forward.
  Tensor forward(const Tensor& x, Saved& saved, ForwardMode mode = ForwardMode::normal,
                 const LinearObserver* observer = nullptr, const Tensor& residual = Tensor());
  /// dx from dy; frees each part of `saved` after its last use (fc2's FP8 input, released by a
  /// training forward, is made again from saved.hidden first). A training forward leaves fc1's
  /// FP8 input in place; the block releases it and rebuilds it from its norm.
  Tensor backward(const Tensor& dy, Saved& saved);

  ops::Activation activation() const { return activation_; }
  Linear& fc1() { return fc1_; }
  Linear& fc2() { return fc2_; }
  const Linear& fc1() const { return fc1_; }
  const Linear& fc2() const { return fc2_; }

 private:
  ops::Activation activation_;
  Linear fc1_;
  Linear fc2_;
};

/// MLP::forward and MLP::backward over two Linears held elsewhere (the C API's LayerNormMLP keeps
/// them as its own handles): fc1 [in -> activation_input_cols(activation, ffn)], fc2 [ffn -> out].
Tensor mlp_forward(ops::Activation activation, Linear& fc1, Linear& fc2, const Tensor& x,
                   MLP::Saved& saved, ForwardMode mode = ForwardMode::normal,
                   const LinearObserver* observer = nullptr, const Tensor& residual = Tensor());
Tensor mlp_backward(ops::Activation activation, Linear& fc1, Linear& fc2, const Tensor& dy,
                    MLP::Saved& saved);

}  // namespace octet::nn
