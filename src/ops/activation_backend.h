// Backend entry points of the activation family (include/octet/ops/activation.h); see
// norm_backend.h for the contract between dispatcher and backends.
#pragma once

#include "octet/ops/activation.h"
#include "ops/norm_backend.h"

namespace octet::ops::cpu {
void activation_forward(Activation act, const Tensor& x, const Tensor& y);
void activation_backward(Activation act, const Tensor& dy, const Tensor& x, const Tensor& dx);
void add(const Tensor& a, const Tensor& b, const Tensor& out);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void activation_forward(Activation act, const Tensor& x, const Tensor& y);
void activation_backward(Activation act, const Tensor& dy, const Tensor& x, const Tensor& dx);
/// The fused FP8 cast: the activation's output computed into the tile quantizer, which writes q's
/// copies, their scales, args.amax and args.column_sums (the last only with q's transposed copy:
/// the return value says whether they were added). y / dx may be undefined (not stored).
bool activation_forward_quantized(Activation act, const Tensor& x, const Tensor& y,
                                  fp8::QuantizedTensor& q, const QuantizeArgs& args);
bool activation_backward_quantized(Activation act, const Tensor& dy, const Tensor& x,
                                   const Tensor& dx, fp8::QuantizedTensor& q,
                                   const QuantizeArgs& args);
void add(const Tensor& a, const Tensor& b, const Tensor& out);
}  // namespace octet::ops::cuda
