// Backend entry points of the norm family (include/octet/ops/norm.h), and the norms' fused FP8
// cast. (Activations fuse theirs through the tile quantizer instead: activation_backend.h.) The
// dispatcher (src/ops/norm.cc) validates arguments and opens the device guard and NVTX range;
// backends may assume valid, non-empty inputs on one device. RMSNorm calls pass undefined tensors
// for beta, mean and dbeta.
#pragma once

#include <cstdint>

#include "octet/ops/norm.h"

namespace octet::ops {

/// The per-tensor FP8 cast that a CUDA kernel fuses into the pass that stores its output y:
/// data[i] = fp8(y[i] * scale[0]) for y[i] as stored (rounded to y's dtype), scale_inv[0] =
/// 1 / scale[0], and, when amax is set, amax[0] = max(amax[0], max|y|) over float bits, published
/// after every store (DESIGN.md rule 1). Exactly what ops::quantize writes for those copies.
///
/// data_t asks for the transposed copy too. A kernel that can write it (the CUDA norms' warp-row
/// path) writes it, publishes the amax, and says so (the backend returns true); one that cannot
/// writes neither it nor the amax, and FusedPlan::finish quantizes the transposed copy from y.
struct FusedCast {
  uint8_t* data = nullptr;  ///< [rows, cols] of y, FP8; nullptr: no fused cast
  float* scale_inv = nullptr;
  uint8_t* data_t = nullptr;     ///< optional [cols, rows]: the transposed copy
  float* scale_inv_t = nullptr;  ///< with data_t, when it is not scale_inv itself
  const float* scale = nullptr;
  float* amax = nullptr;  ///< nullptr: the amax is recorded elsewhere (or not at all)
  DType dtype = DType::e4m3;
  /// false: nobody reads y, a scratch, so a kernel that writes every FP8 copy may skip storing it.
  bool y_wanted = true;
  constexpr bool enabled() const { return data != nullptr; }
  /// The cast without the transposed copy, for a kernel that cannot write it: the amax then waits
  /// for FusedPlan::finish, which publishes it after the transposed copy's stores.
  constexpr FusedCast rowwise_only() const {
    FusedCast c = *this;
    if (c.data_t != nullptr) {
      c.data_t = nullptr;
      c.scale_inv_t = nullptr;
      c.amax = nullptr;
      c.y_wanted = true;
    }
    return c;
  }
};

/// Throws unless `t` is an f32|bf16 tensor with the dtype and shape of `like`; the message names
/// `op`, `name` and `like_name`.
void check_like(const Tensor& t, const Tensor& like, const char* op, const char* name,
                const char* like_name);

/// How a norm honours its optional FusedQuantize. The CUDA backend casts the row-wise per-tensor
/// copy in its kernel (kernel_cast()); everything else (the CPU, block scaling modes, the
/// transposed copy, column sums) is ops::quantize or sum_rows on the finished output, run by
/// finish(). The CPU path is the
/// reference the fused kernels are tested against, bit for bit.
class FusedPlan {
 public:
  /// Validates `fused` (nullptr: nothing to do) against the op's output `y`, which lives on
  /// `device`; throws naming `op` on a shape, dtype or device mismatch. y_wanted: whether the
  /// caller reads y (false: y is the op's scratch, see FusedCast::y_wanted).
  FusedPlan(const FusedQuantize* fused, const Tensor& y, const Device& device, const char* op,
            bool y_wanted);
  /// The cast for the CUDA kernel; disabled unless it fuses anything.
  const FusedCast& kernel_cast() const { return kernel_cast_; }
  /// After the op: quantizes `y` for whatever the kernel did not write. transposed_written: the
  /// backend wrote kernel_cast().data_t (and published the amax).
  void finish(const Tensor& y, bool transposed_written) const;

 private:
  const FusedQuantize* fused_ = nullptr;
  FusedCast kernel_cast_;
};

}  // namespace octet::ops

namespace octet::ops::cpu {
void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                       const Tensor& y, const Tensor& mean, const Tensor& rstd);
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, const Tensor& dx, const Tensor& dgamma,
                        const Tensor& dbeta, const Tensor& residual, bool accumulate_params);
void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, const Tensor& y,
                     const Tensor& rstd);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dgamma, const Tensor& residual,
                      bool accumulate_params);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
// The forwards return whether they wrote the cast's transposed copy (FusedCast::data_t).
bool layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                       const Tensor& y, const Tensor& mean, const Tensor& rstd,
                       const FusedCast& cast);
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, const Tensor& dx, const Tensor& dgamma,
                        const Tensor& dbeta, const Tensor& residual, bool accumulate_params);
bool rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, const Tensor& y,
                     const Tensor& rstd, const FusedCast& cast);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dgamma, const Tensor& residual,
                      bool accumulate_params);
}  // namespace octet::ops::cuda
