// MLP activations: GELU (tanh approximation), SwiGLU, SReLU (squared ReLU).
#pragma once

#include "octet/core/tensor.h"
#include "octet/ops/norm.h"

namespace octet::ops {

enum class Activation : uint8_t {
  gelu,    ///< 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  swiglu,  ///< input [rows, 2F] = [gate | up]: silu(gate) * up -> [rows, F]
  srelu,   ///< max(x, 0)^2
};

/// "gelu", "swiglu" or "srelu".
const char* activation_name(Activation act);

/// Columns of the activation's input for an output of `cols` columns (2x for swiglu).
int64_t activation_input_cols(Activation act, int64_t cols);

/// y = act(x); x, y f32|bf16 (same dtype), computed in f32. Optional fused FP8 cast of y (the next
/// GEMM's input), exactly as ops::quantize(y, *fused->out, fused->args) would write it, column
/// sums included; on CUDA in the same pass, which writes any scaling mode and both copies. With
/// `fused`, y may be undefined: only the FP8 copies are written.
void activation_forward(Activation act, const Tensor& x, const Tensor& y,
                        const FusedQuantize* fused = nullptr);
/// dx = dact(x) * dy (x's dtype). Optional fused FP8 cast of dx (the previous GEMM's grad_output,
/// whose bias gradient fused->args.column_sums can collect), as for the forward; with `fused`, dx
/// may be undefined.
void activation_backward(Activation act, const Tensor& dy, const Tensor& x, const Tensor& dx,
                         const FusedQuantize* fused = nullptr);

/// out = a + b (residual add), all the same shape and dtype; out may alias a or b.
void add(const Tensor& a, const Tensor& b, const Tensor& out);

}  // namespace octet::ops
