// A deliberately non-deterministic dprob reduction (float atomicAdd across CTAs), kept out of the
// library: octet_bench runs it at the field shape to show that the shape exposes summation-order
// non-determinism, beside the library's fixed-order dprob (FIELD-NOTES section 3).
#pragma once

#if OCTET_WITH_CUDA

#include <cuda_runtime.h>

#include "octet/core/tensor.h"

namespace octet::bench {

/// dprob[r] = sum_j dh[r, j] * silu(gate[r, j]) * up[r, j] for bf16 dh [rows, f] and fc1 [rows, 2f]
/// = [gate | up], summed by CTAs of column chunks that each atomicAdd their partial into dprob (f32
/// [rows], zeroed here first): the order of the adds follows the CTA scheduler.
void atomic_reference_dprob(const Tensor& dh, const Tensor& fc1, const Tensor& dprob,
                            cudaStream_t stream);

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
