// Backend entry points of the quantize family (include/octet/ops/quantize.h). The dispatcher in
// src/ops/quantize.cc validates arguments, opens the device guard and NVTX range, then calls one
// of these; backends may assume valid, non-empty inputs on one device.
#pragma once

#include "octet/ops/quantize.h"

namespace octet::ops::cpu {
void amax(const Tensor& x, const Tensor& amax_out);
void quantize(const Tensor& x, fp8::QuantizedTensor& out, const QuantizeArgs& args);
void dequantize(const fp8::QuantizedTensor& q, const Tensor& out, bool transposed);
void cast(const Tensor& x, const Tensor& out);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void amax(const Tensor& x, const Tensor& amax_out);
void quantize(const Tensor& x, fp8::QuantizedTensor& out, const QuantizeArgs& args);
void dequantize(const fp8::QuantizedTensor& q, const Tensor& out, bool transposed);
void cast(const Tensor& x, const Tensor& out);
}  // namespace octet::ops::cuda
