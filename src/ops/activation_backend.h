// Backend entry points of the activation family (include/octet/ops/activation.h); see
// norm_backend.h for the contract between dispatcher and backends and for FusedCast.
#pragma once

#include "octet/ops/activation.h"
#include "ops/norm_backend.h"

namespace octet::ops::cpu {
void activation_forward(Activation act, const Tensor& x, const Tensor& y);
void activation_backward(Activation act, const Tensor& dy, const Tensor& x, const Tensor& dx);
void add(const Tensor& a, const Tensor& b, const Tensor& out);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void activation_forward(Activation act, const Tensor& x, const Tensor& y, const FusedCast& cast);
void activation_backward(Activation act, const Tensor& dy, const Tensor& x, const Tensor& dx,
                         const FusedCast& cast);
void add(const Tensor& a, const Tensor& b, const Tensor& out);
}  // namespace octet::ops::cuda
