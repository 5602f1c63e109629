// Backend entry points of the embedding family (include/octet/ops/embedding.h); see
// quantize_backend.h for the contract between dispatcher and backends. Backends get shapes
// resolved by the dispatcher. CPU backends may also assume every id/target is in range (the
// dispatcher checked them); CUDA backends cannot (the ids live on the GPU), see check_ids.
#pragma once

#include <cstdint>

#include "octet/ops/embedding.h"

namespace octet::ops {

/// Threads per CTA (one CTA per row) of cross_entropy on CUDA, and the lane count of its fixed
/// reduction order (fixed_order_reduce.h), which the CPU reference reproduces: 512 threads keep
/// about 100 logits per thread at GPT-2's vocabulary and fit 4 CTAs on an SM.
inline constexpr int kCrossEntropyLanes = 512;

/// Whether CUDA backends verify ids and targets, a check that synchronises with the host: when
/// env OCTET_CHECK_IDS is set (any value other than empty or "0"). Unchecked, an out-of-range id
/// or target poisons its output with NaN, the same NaN on every run. Determinism does not turn
/// the check on: it is a validation, and its host syncs cost a MoE step double-digit percents.
bool check_ids_requested();

/// Throws octet::Error for `what`[row] = value outside [0, limit), e.g. "embedding_forward: ids[7]
/// = 50304 is outside [0, 50304) ...". `negative_ignores` adds that negative values are allowed.
[[noreturn]] void throw_bad_id(const char* op, const char* what, int64_t row, int64_t value,
                               int64_t limit, bool negative_ignores);

}  // namespace octet::ops

namespace octet::ops::cpu {
void embedding_forward(const Tensor& ids, const Tensor& wte, const Tensor& wpe, int64_t seq,
                       const Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, int64_t seq, const Tensor& dwte,
                        const Tensor& dwpe);
void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                   const Tensor& dlogits, float grad_scale);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
/// With check_ids the launcher waits for the kernel and throws on the first (lowest) bad row.
void embedding_forward(const Tensor& ids, const Tensor& wte, const Tensor& wpe, int64_t seq,
                       const Tensor& out, bool check_ids);
void embedding_backward(const Tensor& ids, const Tensor& dout, int64_t seq, const Tensor& dwte,
                        const Tensor& dwpe, bool check_ids);
void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                   const Tensor& dlogits, float grad_scale, bool check_ids);
}  // namespace octet::ops::cuda
