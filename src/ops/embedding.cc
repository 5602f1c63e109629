// Dispatcher of the embedding family: validates arguments, then runs the CPU or CUDA backend
// through dispatch() (device guard + NVTX range).
//
// Ids and targets: on the CPU they are checked here, before any output is written, and a bad one
// throws naming the row, the id and the vocabulary. On a GPU reading them would cost a host
// synchronisation on every call, so the CUDA kernels record the first bad row in a device flag
// that is read back (synchronously) only when check_ids_requested(); otherwise a bad id or target
// yields NaN outputs for its row and no out-of-bounds access. Trainers pass validated data.
#include "octet/ops/embedding.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ops/dispatch.h"
#include "ops/embedding_backend.h"

namespace octet::ops {
namespace {

/// Validates ids (i32 [batch*seq] or [batch, seq]) against `seq`; returns the row count.
int64_t check_ids(const Tensor& ids, int64_t seq, const char* op) {
  OCTET_CHECK(ids.defined(), op, ": ids is an undefined tensor");
  OCTET_CHECK(ids.dtype() == DType::i32 && (ids.ndim() == 1 || ids.ndim() == 2), op,
              ": ids must be i32[batch*seq] or i32[batch, seq], got ", ids.describe());
  OCTET_CHECK(ids.numel() > 0, op, ": ids is an empty tensor (", ids.describe(), ")");
  OCTET_CHECK(ids.numel() <= INT32_MAX, op, ": at most ", INT32_MAX, " rows are supported, got ",
              ids.describe());
  OCTET_CHECK(seq >= 1, op, ": seq must be >= 1, got ", seq);
  OCTET_CHECK(ids.numel() % seq == 0, op, ": seq must divide the number of rows: got seq ", seq,
              " for ", ids.numel(), " ids (", ids.describe(), ")");
  OCTET_CHECK(ids.ndim() == 1 || ids.size(1) == seq, op, ": ids of shape [batch, seq] must have ",
              seq, " columns for seq ", seq, ", got ", ids.describe());
  return ids.numel();
}

/// Validates an f32 [rows >= 1, dim >= 1] table.
void check_table(const Tensor& t, const char* op, const char* what) {
  OCTET_CHECK(t.defined(), op, ": ", what, " is an undefined tensor");
  OCTET_CHECK(t.dtype() == DType::f32 && t.ndim() == 2, op, ": ", what,
              " must be f32[rows, dim], got ", t.describe());
  OCTET_CHECK(t.numel() > 0, op, ": ", what, " is an empty tensor (", t.describe(), ")");
}

/// Validates an optional position table against the token table's dim and `seq`.
void check_position_table(const Tensor& t, int64_t dim, int64_t seq, const char* op,
                          const char* what) {
  if (!t.defined()) return;
  check_table(t, op, what);
  OCTET_CHECK(t.size(1) == dim, op, ": ", what, " must be f32[max_seq, ", dim,
              "] (dim of the token table), got ", t.describe());
  OCTET_CHECK(t.size(0) >= seq, op, ": ", what, " holds ", t.size(0), " positions, fewer than seq ",
              seq, " (", t.describe(), ")");
}

/// Validates a f32|bf16 activation viewed as [rows, dim].
void check_rows(const Tensor& t, int64_t rows, int64_t dim, const char* op, const char* what) {
  check_float_activation(t, op, what);
  OCTET_CHECK(t.ndim() >= 2 && t.rows() == rows && t.cols() == dim, op, ": ", what, " must be [",
              rows, ", ", dim, "] (rows x dim, leading dims folded), got ", t.describe());
}

/// On the CPU: throws on the first value outside [0, limit) (negatives allowed when
/// `negative_ignores`), naming the row, the value and the limit.
void check_ids_on_host(const Tensor& ids, int64_t limit, bool negative_ignores, const char* op,
                       const char* what) {
  if (!ids.device().is_cpu()) return;
  const int32_t* id = ids.data<int32_t>();
  for (int64_t r = 0; r < ids.numel(); ++r) {
    if (id[r] >= limit || (id[r] < 0 && !negative_ignores))
      throw_bad_id(op, what, r, id[r], limit, negative_ignores);
  }
}

}  // namespace

void throw_bad_id(const char* op, const char* what, int64_t row, int64_t value, int64_t limit,
                  bool negative_ignores) {
  OCTET_ERROR(op, ": ", what, "[", row, "] = ", value, " is outside [0, ", limit,
              ") for a vocabulary of ", limit,
              negative_ignores ? " (negative targets are allowed and ignore their row)" : "");
}

bool check_ids_requested() {
  const char* value = std::getenv("OCTET_CHECK_IDS");
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

void embedding_forward(const Tensor& ids, const Tensor& wte, const Tensor& wpe, int64_t seq,
                       const Tensor& out) {
  constexpr const char* op = "embedding_forward";
  const int64_t rows = check_ids(ids, seq, op);
  check_table(wte, op, "wte");
  const int64_t dim = wte.size(1);
  check_position_table(wpe, dim, seq, op, "wpe");
  check_rows(out, rows, dim, op, "out");
  const Device device = common_device({&ids, &wte, &out, wpe.defined() ? &wpe : nullptr}, op);
  check_ids_on_host(ids, wte.size(0), false, op, "ids");

  dispatch(
      device, op, [&] { cpu::embedding_forward(ids, wte, wpe, seq, out); },
      [&] {
        OCTET_CUDA_ONLY(cuda::embedding_forward(ids, wte, wpe, seq, out, check_ids_requested()));
      });
}

void embedding_backward(const Tensor& ids, const Tensor& dout, int64_t seq, const Tensor& dwte,
                        const Tensor& dwpe) {
  constexpr const char* op = "embedding_backward";
  const int64_t rows = check_ids(ids, seq, op);
  check_table(dwte, op, "dwte");
  const int64_t dim = dwte.size(1);
  check_position_table(dwpe, dim, seq, op, "dwpe");
  check_rows(dout, rows, dim, op, "dout");
  const Device device = common_device({&ids, &dout, &dwte, dwpe.defined() ? &dwpe : nullptr}, op);
  check_ids_on_host(ids, dwte.size(0), false, op, "ids");

  dispatch(
      device, op, [&] { cpu::embedding_backward(ids, dout, seq, dwte, dwpe); },
      [&] {
        OCTET_CUDA_ONLY(
            cuda::embedding_backward(ids, dout, seq, dwte, dwpe, check_ids_requested()));
      });
}

void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                   const Tensor& dlogits, float grad_scale) {
  constexpr const char* op = "cross_entropy";
  check_float_activation(logits, op, "logits");
  const int64_t rows = logits.rows();
  const int64_t vocab = logits.cols();
  OCTET_CHECK(vocab <= INT32_MAX, op, ": the vocabulary must fit i32 targets, got ",
              logits.describe());
  OCTET_CHECK(targets.defined(), op, ": targets is an undefined tensor");
  OCTET_CHECK(targets.dtype() == DType::i32 && targets.numel() == rows, op,
              ": targets must be i32[", rows, "] (one per row of logits ", logits.describe(),
              "), got ", targets.describe());
  OCTET_CHECK(losses.defined(), op, ": losses is an undefined tensor");
  OCTET_CHECK(losses.dtype() == DType::f32 && losses.numel() == rows, op, ": losses must be f32[",
              rows, "] (one per row of logits ", logits.describe(), "), got ", losses.describe());
  if (dlogits.defined())
    OCTET_CHECK(dlogits.dtype() == logits.dtype() && dlogits.shape() == logits.shape(), op,
                ": dlogits must match logits ", logits.describe(), ", got ", dlogits.describe());
  OCTET_CHECK(std::isfinite(grad_scale), op, ": grad_scale must be finite, got ", grad_scale);
  const Device device =
      common_device({&logits, &targets, &losses, dlogits.defined() ? &dlogits : nullptr}, op);
  check_ids_on_host(targets, vocab, true, op, "targets");

  dispatch(
      device, op, [&] { cpu::cross_entropy(logits, targets, losses, dlogits, grad_scale); },
      [&] {
        OCTET_CUDA_ONLY(cuda::cross_entropy(logits, targets, losses, dlogits, grad_scale,
                                            check_ids_requested()));
      });
}

}  // namespace octet::ops
