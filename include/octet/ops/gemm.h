// GEMM: D = alpha * op(A) * op(B) + beta * D + bias (+ an addend matrix), row-major, FP32
// accumulation.
#pragma once

#include "octet/core/tensor.h"
#include "octet/fp8/quantized_tensor.h"

namespace octet::ops {

/// One GEMM input: a [rows, cols] matrix, with scales when it is FP8.
struct GemmOperand {
  Tensor data;       ///< f32, bf16, e4m3 or e5m2; 2-D (leading dims are folded into rows)
  Tensor scale_inv;  ///< FP8 only: per the scaling mode, for `data` as stored
  fp8::ScalingMode mode = fp8::ScalingMode::per_tensor;
  bool transpose = false;  ///< use data^T

  static GemmOperand dense(const Tensor& data, bool transpose = false);
  /// The row-wise copy of q, or its transposed copy (data_t with scale_inv_t).
  static GemmOperand fp8(const fp8::QuantizedTensor& q, bool use_transposed_copy,
                         bool transpose = false);
};

/// Forward GEMMs use fast accumulation (Hopper's FP8 tensor cores keep fewer bits of the running
/// sum between promotions); dgrad and wgrad use split accumulation (promote to FP32 regularly).
enum class Accumulation : uint8_t { fast, split };

struct GemmArgs {
  float alpha = 1.0f;
  float beta = 0.0f;  ///< 1 accumulates into D (gradient accumulation)
  Tensor bias;        ///< optional [N], f32 or bf16, added to every row
  /// Optional [M, N] matrix in D's dtype, added with weight 1 (cuBLASLt's C with beta = 1, D
  /// written elsewhere): a residual add fused into the GEMM. It must not share memory with D, and
  /// it excludes beta != 0 (beta reads D itself; use one or the other). With an addend a bf16 D is
  /// computed as bf16(bf16(alpha * acc) + bias + addend) (docs/NUMERICS.md, GEMM).
  Tensor addend;
  Accumulation accumulation = Accumulation::split;
};

/// D [M, N] (f32 or bf16) = alpha * op(A) [M, K] * op(B) [K, N] + beta * D + bias + addend.
///
/// Dense operands: any transposes; A and B of one dtype (f32 or bf16).
/// FP8 operands: both FP8 (e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3), the TN layout Hopper requires
/// (A not transposed, B transposed, so both are K-contiguous), M, N and K multiples of 16 (the
/// cuBLASLt rule, enforced on every backend), and matching scaling modes: per_tensor x
/// per_tensor, block_1x128 x {block_1x128, block_128x128}, or mxfp8_1x32 x mxfp8_1x32.
void gemm(const GemmOperand& a, const GemmOperand& b, const Tensor& d, const GemmArgs& args = {});

/// GEMM plans made so far in this process (0 without CUDA): one cuBLASLt heuristic query the first
/// time a device sees a GEMM's shape, dtypes and layouts, a host-side cost. A count that keeps
/// growing during training means the shapes keep changing (an MoE's rows per expert).
uint64_t gemm_plans_made();
/// Host seconds spent making those plans (0 without CUDA).
double gemm_planning_seconds();
/// Device bytes the GEMM backend holds on `device` for its own use (cuBLASLt's workspace, made
/// at the device's first GEMM and kept for the process); 0 on the CPU.
size_t gemm_workspace_bytes(const Device& device);

}  // namespace octet::ops
