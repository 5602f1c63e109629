#include "octet/ops/reduce.h"

#include "ops/dispatch.h"
#include "ops/reduce_backend.h"

namespace octet::ops {

void sum_rows(const Tensor& x, const Tensor& out, bool accumulate) {
  const Device device = common_device({&x, &out}, "sum_rows");
  OCTET_CHECK(is_high_precision(x.dtype()), "sum_rows: x must be f32 or bf16, got ", x.describe());
  OCTET_CHECK(x.ndim() >= 1, "sum_rows: x must have at least 1 dimension, got ", x.describe());
  OCTET_CHECK(out.dtype() == DType::f32 && out.ndim() == 1 && out.numel() == x.cols(),
              "sum_rows: out must be f32[", x.cols(), "] for x ", x.describe(), ", got ",
              out.describe());
  if (out.numel() == 0) return;
  if (x.numel() == 0) {                   // no rows: the sum is zero
    if (!accumulate) Tensor(out).zero();  // a handle to the same storage
    return;
  }
  dispatch(
      device, "sum_rows", [&] { cpu::sum_rows(x, out, accumulate); },
      [&] { OCTET_CUDA_ONLY(cuda::sum_rows(x, out, accumulate)); });
}

}  // namespace octet::ops
