// Dispatcher of the optimizer family: validates arguments, then runs the CPU or CUDA backend
// through dispatch() (device guard + NVTX range).
#include "octet/ops/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "ops/byte_ranges.h"
#include "ops/dispatch.h"
#include "ops/optimizer_backend.h"
#include "ops/quantize_backend.h"

namespace octet::ops {
namespace {

/// Throws unless `t` is a non-empty f32 tensor, naming `op` and `what` (anything streamable).
template <typename Name>
void check_f32(const Tensor& t, const char* op, const Name& what) {
  OCTET_CHECK(t.defined(), op, ": ", what, " is an undefined tensor");
  OCTET_CHECK(t.dtype() == DType::f32, op, ": ", what, " must be f32, got ", t.describe());
  OCTET_CHECK(t.numel() > 0, op, ": ", what, " is an empty tensor (", t.describe(), ")");
}

void check_norm_sq(const Tensor& norm_sq, const char* op) {
  OCTET_CHECK(norm_sq.defined(), op, ": norm_sq is an undefined tensor");
  OCTET_CHECK(norm_sq.dtype() == DType::f32 && norm_sq.shape() == Shape{1}, op,
              ": norm_sq must be f32[1], got ", norm_sq.describe());
}

void check_finite(float value, const char* op, const char* name, const char* expected) {
  OCTET_CHECK(std::isfinite(value), op, ": ", name, " must be finite (", expected, "), got ",
              value);
}

/// Everything of AdamWArgs but the weight decay, which the multi-tensor step takes per tensor.
void check_adamw_args(const AdamWArgs& a, const char* op) {
  check_finite(a.lr, op, "lr", ">= 0");
  OCTET_CHECK(a.lr >= 0.0f, op, ": lr must be >= 0, got ", a.lr);
  OCTET_CHECK(a.beta1 >= 0.0f && a.beta1 < 1.0f, op, ": beta1 must be in [0, 1), got ", a.beta1);
  OCTET_CHECK(a.beta2 >= 0.0f && a.beta2 < 1.0f, op, ": beta2 must be in [0, 1), got ", a.beta2);
  check_finite(a.eps, op, "eps", "> 0");
  OCTET_CHECK(a.eps > 0.0f, op, ": eps must be > 0, got ", a.eps);
  OCTET_CHECK(a.step >= 1, op, ": step is 1-based and must be >= 1, got ", a.step);
  check_finite(a.max_grad_norm, op, "max_grad_norm", "<= 0 disables clipping");
}

/// A field of an AdamW entry as messages name it: "grad" in the one-tensor step (index < 0),
/// "tensors[3].grad" in the multi-tensor step. Streamed only when a check fails, so validating
/// hundreds of entries every step builds no strings.
struct EntryName {
  int index;
  const char* field;
};

std::ostream& operator<<(std::ostream& out, const EntryName& name) {
  if (name.index >= 0) out << "tensors[" << name.index << "].";
  return out << name.field;
}

/// Throws unless entry `index` (param, grad, m, v) holds f32 tensors of param's shape on param's
/// device, and a finite weight decay >= 0.
void check_adamw_tensor(const AdamWTensor& t, int index, const char* op) {
  const std::pair<const Tensor*, const char*> state[] = {
      {&t.param, "param"}, {&t.grad, "grad"}, {&t.m, "m"}, {&t.v, "v"}};
  for (const auto& [tensor, field] : state) check_f32(*tensor, op, EntryName{index, field});
  for (const auto& [tensor, field] : state) {
    OCTET_CHECK(tensor->shape() == t.param.shape(), op, ": ", EntryName{index, field},
                " must have param's shape ", shape_str(t.param.shape()), ", got ",
                tensor->describe());
    OCTET_CHECK(tensor->device() == t.param.device(), op,
                ": all tensors must be on one device, got ", EntryName{index, "param"}, " ",
                t.param.describe(), " and ", EntryName{index, field}, " ", tensor->describe());
  }
  const EntryName decay{index, "weight_decay"};
  OCTET_CHECK(std::isfinite(t.weight_decay), op, ": ", decay, " must be finite (>= 0), got ",
              t.weight_decay);
  OCTET_CHECK(t.weight_decay >= 0.0f, op, ": ", decay, " must be >= 0, got ", t.weight_decay);
}

/// Throws if two entries write the same memory (a tensor listed twice): one launch updates all
/// entries at once, so unlike one step per tensor it would race instead of stepping twice.
void check_no_overlap(const AdamWTensor* tensors, int count, const char* op) {
  constexpr const char* kFields[] = {"param", "m", "v", "bf16_copy"};
  constexpr int kFieldCount = 4;
  std::vector<ByteRange> written;  // entry = tensor index * kFieldCount + field
  for (int i = 0; i < count; ++i) {
    const Tensor* state[kFieldCount] = {&tensors[i].param, &tensors[i].m, &tensors[i].v,
                                        &tensors[i].bf16_copy};
    for (int f = 0; f < kFieldCount; ++f)
      if (state[f]->defined()) written.push_back(byte_range(*state[f], i * kFieldCount + f));
  }
  if (const auto pair = sort_and_find_overlap(written)) {
    const auto [a, b] = *pair;
    OCTET_ERROR(op, ": tensors[", b.entry / kFieldCount, "].", kFields[b.entry % kFieldCount],
                " overlaps tensors[", a.entry / kFieldCount, "].", kFields[a.entry % kFieldCount],
                " in memory; every tensor written must appear once");
  }
}

/// Throws unless entry `index`'s bf16 copy (when it has one) is bf16 of param's shape and device.
void check_adamw_bf16_copy(const AdamWTensor& t, int index, const char* op) {
  if (!t.bf16_copy.defined()) return;
  const EntryName name{index, "bf16_copy"};
  OCTET_CHECK(t.bf16_copy.dtype() == DType::bf16 && t.bf16_copy.shape() == t.param.shape(), op,
              ": ", name, " must be bf16 of param's shape ", shape_str(t.param.shape()), ", got ",
              t.bf16_copy.describe());
  OCTET_CHECK(t.bf16_copy.device() == t.param.device(), op,
              ": all tensors must be on one device, got param ", t.param.describe(), " and ", name,
              " ", t.bf16_copy.describe());
}

/// Throws unless entry `index`'s cast (when it has one) can be written with the step.
void check_adamw_cast(const AdamWTensor& t, int index, const char* op) {
  if (t.cast == nullptr) return;
  const std::string what = "tensors[" + std::to_string(index) + "].cast";
  OCTET_CHECK(t.cast->out != nullptr, op, ": ", what, "->out is null; expected the ",
              "QuantizedTensor to write the parameter's FP8 cast into");
  OCTET_CHECK(t.param.ndim() == 2, op, ": ", what, " needs a 2-D parameter (a weight matrix), got ",
              t.param.describe());
  OCTET_CHECK(t.cast->out->mode == fp8::ScalingMode::per_tensor, op, ": ", what,
              " supports per_tensor scaling only, got ", fp8::scaling_mode_name(t.cast->out->mode));
  OCTET_CHECK(!t.cast->args.column_sums.defined(), op, ": ", what,
              " takes no column sums (a weight has no bias gradient to sum)");
  check_quantize_target(op, t.param.rows(), t.param.cols(), *t.cast->out, t.cast->args, t.param);
}

/// Calls f(begin, end, device) for each run [begin, end) of consecutive entries on one device
/// (device_of(i): entry i's), in order: a model split over devices has one run per stage.
template <typename DeviceOf, typename F>
void for_each_device_run(int count, DeviceOf device_of, F&& f) {
  for (int begin = 0, end = 0; begin < count; begin = end) {
    const Device device = device_of(begin);
    while (end < count && device_of(end) == device) ++end;
    f(begin, end, device);
  }
}

/// Runs the validated step: one launch per run of entries on one device, with norm_sq copied
/// there when it lies elsewhere (the same float, so the same clip factor). The CPU casts with
/// ops::quantize and ops::cast after its step; the CUDA backend writes the casts and copies
/// itself.
void run_adamw(const AdamWTensor* tensors, int count, const Tensor& norm_sq, const AdamWArgs& args,
               const char* op) {
  const AdamWCoefficients coefficients = adamw_coefficients(args);
  for_each_device_run(
      count, [&](int i) { return tensors[i].param.device(); },
      [&](int begin, int end, const Device& device) {
        const AdamWTensor* run = tensors + begin;
        const int n = end - begin;
        const Tensor norm = norm_sq.device() == device ? norm_sq : norm_sq.to(device);
        dispatch(
            device, op,
            [&] {
              cpu::adamw_step(run, n, norm, coefficients);
              for (int i = 0; i < n; ++i) {
                if (run[i].cast != nullptr)
                  quantize(run[i].param, *run[i].cast->out, run[i].cast->args);
                if (run[i].bf16_copy.defined()) cast(run[i].param, run[i].bf16_copy);
              }
            },
            [&] { OCTET_CUDA_ONLY(cuda::adamw_step(run, n, norm, coefficients)); });
      });
}

}  // namespace

void global_norm_squared(const Tensor* grads, int count, const Tensor& norm_sq) {
  constexpr const char* op = "global_norm_squared";
  OCTET_CHECK(count >= 1, op, ": expected at least one gradient tensor, got count ", count);
  OCTET_CHECK(grads != nullptr, op, ": grads is null but count is ", count);
  check_norm_sq(norm_sq, op);
  for (int i = 0; i < count; ++i) check_f32(grads[i], op, "grads[" + std::to_string(i) + "]");

  // Each run of consecutive gradients on one device gets its tensor sums there; they meet in
  // order on norm_sq's device, so the total is the one-device total bit for bit.
  const Tensor sums = Tensor::empty({count}, DType::i64, norm_sq.device());
  for_each_device_run(
      count, [&](int i) { return grads[i].device(); },
      [&](int begin, int end, const Device& device) {
        Tensor slots = sums.slice(begin, end);
        const bool local = device == norm_sq.device();
        const Tensor here = local ? slots : Tensor::empty({end - begin}, DType::i64, device);
        dispatch(
            device, op, [&] { cpu::tensor_norm_sums(grads + begin, end - begin, here); },
            [&] { OCTET_CUDA_ONLY(cuda::tensor_norm_sums(grads + begin, end - begin, here)); });
        if (!local) slots.copy_from(here);
      });
  dispatch(
      norm_sq.device(), op, [&] { cpu::sum_tensor_norms(sums, norm_sq); },
      [&] { OCTET_CUDA_ONLY(cuda::sum_tensor_norms(sums, norm_sq)); });
}

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const Tensor& norm_sq, const AdamWArgs& args) {
  constexpr const char* op = "adamw_step";
  check_norm_sq(norm_sq, op);
  const AdamWTensor one{param, grad, m, v, args.weight_decay};
  check_adamw_tensor(one, -1, op);
  check_adamw_args(args, op);
  run_adamw(&one, 1, norm_sq, args, op);
}

void adamw_step(const AdamWTensor* tensors, int count, const Tensor& norm_sq,
                const AdamWArgs& args) {
  constexpr const char* op = "adamw_step";
  OCTET_CHECK(count >= 1, op, ": expected at least one tensor, got count ", count);
  OCTET_CHECK(tensors != nullptr, op, ": tensors is null but count is ", count);
  check_norm_sq(norm_sq, op);
  for (int i = 0; i < count; ++i) {
    check_adamw_tensor(tensors[i], i, op);
    check_adamw_cast(tensors[i], i, op);
    check_adamw_bf16_copy(tensors[i], i, op);
  }
  check_no_overlap(tensors, count, op);
  check_adamw_args(args, op);
  run_adamw(tensors, count, norm_sq, args, op);
}

}  // namespace octet::ops
