// Dispatcher of the MoE family: validates every argument (messages name what was expected and what
// was received), then runs the backend of the tensors' device through dispatch().
#include "octet/ops/moe.h"

#include <string>

#include "octet/core/carve.h"
#include "ops/dispatch.h"
#include "ops/moe_backend.h"
#include "ops/moe_math.h"
#include "ops/quantize_backend.h"

namespace octet::ops {
namespace {

/// Throws unless t is defined with `dtype` and `shape`.
void check_tensor(const Tensor& t, DType dtype, const Shape& shape, const char* op,
                  const char* what) {
  OCTET_CHECK(t.defined(), op, ": ", what, " is an undefined tensor; expected ", dtype_name(dtype),
              " ", shape_str(shape));
  OCTET_CHECK(t.dtype() == dtype && t.shape() == shape, op, ": ", what, " must be ",
              dtype_name(dtype), " ", shape_str(shape), ", got ", t.describe());
}

/// Throws unless t is a 2-d f32|bf16 tensor of `rows` rows.
void check_rows(const Tensor& t, int64_t rows, const char* op, const char* what) {
  check_float_activation(t, op, what);
  OCTET_CHECK(t.ndim() == 2 && t.size(0) == rows, op, ": ", what, " must be [", rows,
              ", cols], got ", t.describe());
}

/// Throws unless the plan's tensors are consistent (i32, capacity rows, [tokens, topk]).
void check_plan(const MoePlan& plan, int64_t tokens, int64_t topk, const char* op) {
  OCTET_CHECK(plan.offsets.defined() && plan.offsets.ndim() == 1 && plan.offsets.numel() >= 2,
              op, ": plan.offsets must be i32 [experts + 1], got ", plan.offsets.describe());
  const int64_t experts = plan.experts();
  check_tensor(plan.offsets, DType::i32, {experts + 1}, op, "plan.offsets");
  check_tensor(plan.row_map, DType::i32, {moe_capacity(tokens, topk, experts), 2}, op,
               "plan.row_map");
  check_tensor(plan.slot_row, DType::i32, {tokens, topk}, op, "plan.slot_row");
}

Device plan_device(const MoePlan& plan, std::initializer_list<const Tensor*> others,
                   const char* op) {
  Device device = common_device({&plan.offsets, &plan.row_map, &plan.slot_row}, op);
  const Device others_device = common_device(others, op);
  OCTET_CHECK(device == others_device, op, ": the plan is on ", device, ", the tensors on ",
              others_device);
  return device;
}

void check_router_args(const RouterArgs& args, int64_t experts, const char* op) {
  OCTET_CHECK(args.topk >= 1 && args.topk <= experts, op, ": topk must be in [1, experts = ",
              experts, "], got ", args.topk);
  OCTET_CHECK(args.aux_loss_coef >= 0.0f && args.z_loss_coef >= 0.0f, op,
              ": loss coefficients must be >= 0, got aux ", args.aux_loss_coef, ", z ",
              args.z_loss_coef);
  if (args.selection_bias.defined()) {
    OCTET_CHECK(args.scoring == RouterScoring::sigmoid, op,
                ": selection_bias is for sigmoid scoring (aux-loss-free balancing), got ",
                router_scoring_name(args.scoring));
    check_tensor(args.selection_bias, DType::f32, {experts}, op, "selection_bias");
  }
}

void check_router_outputs(const RouterOutputs& out, int64_t tokens, int64_t experts, int64_t topk,
                          const char* op) {
  check_tensor(out.expert, DType::i32, {tokens, topk}, op, "expert");
  check_tensor(out.prob, DType::f32, {tokens, topk}, op, "prob");
  check_tensor(out.counts, DType::i32, {experts}, op, "counts");
  check_tensor(out.scores, DType::f32, {tokens, experts}, op, "scores");
  check_tensor(out.lse, DType::f32, {tokens}, op, "lse");
  check_tensor(out.aux_loss, DType::f32, {1}, op, "aux_loss");
  check_tensor(out.z_loss, DType::f32, {1}, op, "z_loss");
}

const Tensor* optional(const Tensor& t) { return t.defined() ? &t : nullptr; }

/// Validates per-expert FP8 targets of a [capacity, f] output against the plan. The host offsets
/// are compared with plan.offsets where that needs no device read (the CPU).
void check_expert_casts(const MoeExpertCasts& casts, const MoePlan& plan, int64_t f,
                        const Tensor& source, const char* op) {
  const int64_t experts = plan.experts();
  OCTET_CHECK(static_cast<int64_t>(casts.offsets.size()) == experts + 1 &&
                  static_cast<int64_t>(casts.experts.size()) == experts,
              op, ": casts must hold ", experts + 1, " offsets and ", experts,
              " targets (one per expert), got ", casts.offsets.size(), " and ",
              casts.experts.size());
  OCTET_CHECK(casts.offsets[0] == 0 && casts.offsets[experts] <= plan.capacity(), op,
              ": casts.offsets must run from 0 to at most the capacity ", plan.capacity(),
              ", got ", casts.offsets[0], " .. ", casts.offsets[experts]);
  if (plan.offsets.device().is_cpu()) {
    const int32_t* device_offsets = plan.offsets.data<int32_t>();
    for (int64_t e = 0; e <= experts; ++e)
      OCTET_CHECK(casts.offsets[e] == device_offsets[e], op, ": casts.offsets[", e, "] is ",
                  casts.offsets[e], " but the plan's is ", device_offsets[e],
                  " (expected plan.offsets read to the host)");
  }
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = casts.offsets[e + 1] - casts.offsets[e];
    OCTET_CHECK(rows >= 0, op, ": casts.offsets must not decrease, got ", casts.offsets[e + 1],
                " after ", casts.offsets[e], " (expert ", e, ")");
    if (rows == 0) continue;
    const FusedQuantize& target = casts.experts[e];
    OCTET_CHECK(target.out != nullptr, op, ": expert ", e, " has ", rows,
                " rows but no QuantizedTensor to write FC2's input into");
    OCTET_CHECK(!target.args.column_sums.defined(), op, ": expert ", e,
                ": column sums are not supported by the fused cast of FC2's input");
    check_quantize_target(op, rows, f, *target.out, target.args, source);
  }
}

/// Validates the scaled activation's common arguments; returns F (the output columns).
int64_t check_scaled_activation(MoeActivation act, const Tensor& fc1, const Tensor& row_prob,
                                const MoePlan& plan, const Tensor& bias, const char* op) {
  const int64_t capacity = plan.capacity();
  check_rows(fc1, capacity, op, "fc1");
  OCTET_CHECK(!moe::gated(act) || fc1.cols() % 2 == 0, op, ": ",
              moe_activation_name(act), " needs an even number of fc1 columns ([gate | up]), got ",
              fc1.describe());
  const int64_t f = moe::gated(act) ? fc1.cols() / 2 : fc1.cols();
  check_tensor(row_prob, DType::f32, {capacity}, op, "row_prob");
  check_tensor(plan.offsets, DType::i32, {plan.experts() + 1}, op, "plan.offsets");
  if (bias.defined()) check_tensor(bias, DType::f32, {plan.experts(), f}, op, "bias");
  return f;
}

}  // namespace

const char* router_scoring_name(RouterScoring scoring) {
  switch (scoring) {
    case RouterScoring::softmax:
      return "softmax";
    case RouterScoring::sigmoid:
      return "sigmoid";
  }
  OCTET_ERROR("unknown RouterScoring value ", static_cast<int>(scoring));
}

const char* moe_activation_name(MoeActivation act) {
  switch (act) {
    case MoeActivation::swiglu:
      return "swiglu";
    case MoeActivation::geglu:
      return "geglu";
    case MoeActivation::srelu:
      return "srelu";
    case MoeActivation::gelu:
      return "gelu";
  }
  OCTET_ERROR("unknown MoeActivation value ", static_cast<int>(act));
}

int64_t moe_activation_input_cols(MoeActivation act, int64_t f) {
  return moe::gated(act) ? 2 * f : f;
}

RouterOutputs RouterOutputs::allocate(int64_t tokens, int64_t experts, int64_t topk,
                                      const Device& device) {
  // One allocation for all seven: they are made, kept and dropped together, once per MoE layer
  // and forward, and on a GPU each allocation costs host time.
  RouterOutputs out;
  TensorCarver carver(device);
  carver.place({tokens, topk}, DType::i32, &out.expert);
  carver.place({tokens, topk}, DType::f32, &out.prob);
  carver.place({experts}, DType::i32, &out.counts);
  carver.place({tokens, experts}, DType::f32, &out.scores);
  carver.place({tokens}, DType::f32, &out.lse);
  carver.place({1}, DType::f32, &out.aux_loss);
  carver.place({1}, DType::f32, &out.z_loss);
  carver.allocate();
  return out;
}

int64_t moe_capacity(int64_t tokens, int64_t topk, int64_t experts) {
  const int64_t rows = tokens * topk + experts * (kMoeGroupAlign - 1);
  return (rows + kMoeGroupAlign - 1) / kMoeGroupAlign * kMoeGroupAlign;
}

MoePlan MoePlan::allocate(int64_t tokens, int64_t topk, int64_t experts, const Device& device) {
  MoePlan plan;  // one allocation, as RouterOutputs::allocate
  TensorCarver carver(device);
  carver.place({experts + 1}, DType::i32, &plan.offsets);
  carver.place({moe_capacity(tokens, topk, experts), 2}, DType::i32, &plan.row_map);
  carver.place({tokens, topk}, DType::i32, &plan.slot_row);
  carver.allocate();
  return plan;
}

void router_forward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& out) {
  constexpr const char* op = "router_forward";
  OCTET_CHECK(logits.defined() && logits.dtype() == DType::f32 && logits.ndim() == 2 &&
                  logits.numel() > 0,
              op, ": logits must be a non-empty f32 [tokens, experts], got ", logits.describe());
  const int64_t tokens = logits.rows(), experts = logits.cols();
  check_router_args(args, experts, op);
  check_router_outputs(out, tokens, experts, args.topk, op);
  const Device device =
      common_device({&logits, &out.expert, &out.prob, &out.counts, &out.scores, &out.lse,
                     &out.aux_loss, &out.z_loss, optional(args.selection_bias)},
                    op);
  dispatch(
      device, op, [&] { cpu::router_forward(logits, args, out); },
      [&] { OCTET_CUDA_ONLY(cuda::router_forward(logits, args, out)); });
}

void router_logits(const Tensor& x, const Tensor& weight, const Tensor& logits) {
  constexpr const char* op = "router_logits";
  check_float_activation(x, op, "x");
  OCTET_CHECK(x.ndim() == 2, op, ": x must be [tokens, dim], got ", x.describe());
  OCTET_CHECK(weight.defined() && weight.ndim() == 2 && weight.numel() > 0, op,
              ": weight must be a non-empty f32 [experts, ", x.cols(), "], got ",
              weight.describe());
  check_tensor(weight, DType::f32, {weight.rows(), x.cols()}, op, "weight");
  check_tensor(logits, DType::f32, {x.rows(), weight.rows()}, op, "logits");
  const Device device = common_device({&x, &weight, &logits}, op);
  const std::string label =
      op_label(op, dtype_name(x.dtype()), " ", x.rows(), "x", x.cols(), "x", weight.rows());
  dispatch(
      device, label.c_str(), [&] { cpu::router_logits(x, weight, logits); },
      [&] { OCTET_CUDA_ONLY(cuda::router_logits(x, weight, logits)); });
}

void router_logits_backward(const Tensor& x, const Tensor& weight, const Tensor& dlogits,
                            const Tensor& dx, const Tensor& dweight, bool accumulate) {
  constexpr const char* op = "router_logits_backward";
  check_float_activation(x, op, "x");
  OCTET_CHECK(x.ndim() == 2, op, ": x must be [tokens, dim], got ", x.describe());
  OCTET_CHECK(weight.defined() && weight.ndim() == 2 && weight.numel() > 0, op,
              ": weight must be a non-empty f32 [experts, ", x.cols(), "], got ",
              weight.describe());
  const int64_t tokens = x.rows(), dim = x.cols(), experts = weight.rows();
  check_tensor(weight, DType::f32, {experts, dim}, op, "weight");
  check_tensor(dlogits, DType::f32, {tokens, experts}, op, "dlogits");
  check_tensor(dx, x.dtype(), {tokens, dim}, op, "dx");
  check_tensor(dweight, DType::f32, {experts, dim}, op, "dweight");
  const Device device = common_device({&x, &weight, &dlogits, &dx, &dweight}, op);
  const std::string label =
      op_label(op, dtype_name(x.dtype()), " ", tokens, "x", dim, "x", experts);
  dispatch(
      device, label.c_str(),
      [&] { cpu::router_logits_backward(x, weight, dlogits, dx, dweight, accumulate); },
      [&] {
        OCTET_CUDA_ONLY(cuda::router_logits_backward(x, weight, dlogits, dx, dweight, accumulate));
      });
}

void router_backward(const Tensor& logits, const RouterArgs& args, const RouterOutputs& saved,
                     const Tensor& dprob, const Tensor& dlogits) {
  constexpr const char* op = "router_backward";
  OCTET_CHECK(logits.defined() && logits.dtype() == DType::f32 && logits.ndim() == 2 &&
                  logits.numel() > 0,
              op, ": logits must be a non-empty f32 [tokens, experts], got ", logits.describe());
  const int64_t tokens = logits.rows(), experts = logits.cols();
  check_router_args(args, experts, op);
  check_router_outputs(saved, tokens, experts, args.topk, op);
  check_tensor(dprob, DType::f32, {tokens, args.topk}, op, "dprob");
  check_tensor(dlogits, DType::f32, {tokens, experts}, op, "dlogits");
  const Device device =
      common_device({&logits, &saved.expert, &saved.prob, &saved.counts, &saved.scores,
                     &saved.lse, &dprob, &dlogits},
                    op);
  dispatch(
      device, op, [&] { cpu::router_backward(logits, args, saved, dprob, dlogits); },
      [&] { OCTET_CUDA_ONLY(cuda::router_backward(logits, args, saved, dprob, dlogits)); });
}

void moe_plan(const Tensor& expert, const MoePlan& plan) {
  constexpr const char* op = "moe_plan";
  OCTET_CHECK(expert.defined() && expert.dtype() == DType::i32 && expert.ndim() == 2 &&
                  expert.numel() > 0,
              op, ": expert must be a non-empty i32 [tokens, topk], got ", expert.describe());
  check_plan(plan, expert.size(0), expert.size(1), op);
  const Device device = plan_device(plan, {&expert}, op);
  if (device.is_cpu()) {
    // The CUDA backend trusts the router's indices (reading them back would sync with the host).
    const int32_t* e = expert.data<int32_t>();
    for (int64_t i = 0; i < expert.numel(); ++i)
      OCTET_CHECK(e[i] >= 0 && e[i] < plan.experts(), op, ": expert[", i / expert.size(1), ", ",
                  i % expert.size(1), "] = ", e[i], " is outside [0, ", plan.experts(), ")");
  }
  dispatch(
      device, op, [&] { cpu::moe_plan(expert, plan); },
      [&] { OCTET_CUDA_ONLY(cuda::moe_plan(expert, plan)); });
}

void moe_dispatch(const Tensor& x, const MoePlan& plan, const Tensor& permuted) {
  constexpr const char* op = "moe_dispatch";
  check_float_activation(x, op, "x");
  OCTET_CHECK(x.ndim() == 2, op, ": x must be [tokens, dim], got ", x.describe());
  check_plan(plan, x.rows(), plan.slot_row.defined() ? plan.slot_row.size(-1) : 0, op);
  check_tensor(permuted, x.dtype(), {plan.capacity(), x.cols()}, op, "permuted");
  const Device device = plan_device(plan, {&x, &permuted}, op);
  dispatch(
      device, op, [&] { cpu::moe_dispatch(x, plan, permuted); },
      [&] { OCTET_CUDA_ONLY(cuda::moe_dispatch(x, plan, permuted)); });
}

void moe_dispatch_backward(const Tensor& d_permuted, const MoePlan& plan, const Tensor& dx) {
  constexpr const char* op = "moe_dispatch_backward";
  check_float_activation(dx, op, "dx");
  OCTET_CHECK(dx.ndim() == 2, op, ": dx must be [tokens, dim], got ", dx.describe());
  check_plan(plan, dx.rows(), plan.slot_row.defined() ? plan.slot_row.size(-1) : 0, op);
  check_tensor(d_permuted, dx.dtype(), {plan.capacity(), dx.cols()}, op, "d_permuted");
  const Device device = plan_device(plan, {&d_permuted, &dx}, op);
  dispatch(
      device, op, [&] { cpu::moe_dispatch_backward(d_permuted, plan, dx); },
      [&] { OCTET_CUDA_ONLY(cuda::moe_dispatch_backward(d_permuted, plan, dx)); });
}

void moe_combine(const Tensor& expert_out, const Tensor& prob, const MoePlan& plan,
                 const Tensor& y) {
  constexpr const char* op = "moe_combine";
  check_float_activation(y, op, "y");
  OCTET_CHECK(y.ndim() == 2, op, ": y must be [tokens, dim], got ", y.describe());
  const int64_t tokens = y.rows(), topk = plan.slot_row.defined() ? plan.slot_row.size(-1) : 0;
  check_plan(plan, tokens, topk, op);
  check_tensor(expert_out, y.dtype(), {plan.capacity(), y.cols()}, op, "expert_out");
  if (prob.defined()) check_tensor(prob, DType::f32, {tokens, topk}, op, "prob");
  const Device device = plan_device(plan, {&expert_out, &y, optional(prob)}, op);
  dispatch(
      device, op, [&] { cpu::moe_combine(expert_out, prob, plan, y); },
      [&] { OCTET_CUDA_ONLY(cuda::moe_combine(expert_out, prob, plan, y)); });
}

void moe_combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& prob,
                          const MoePlan& plan, const Tensor& d_expert_out, const Tensor& dprob) {
  constexpr const char* op = "moe_combine_backward";
  check_float_activation(dy, op, "dy");
  OCTET_CHECK(dy.ndim() == 2, op, ": dy must be [tokens, dim], got ", dy.describe());
  const int64_t tokens = dy.rows(), topk = plan.slot_row.defined() ? plan.slot_row.size(-1) : 0;
  check_plan(plan, tokens, topk, op);
  check_tensor(d_expert_out, dy.dtype(), {plan.capacity(), dy.cols()}, op, "d_expert_out");
  OCTET_CHECK(prob.defined() == dprob.defined(), op,
              ": dprob is written exactly when prob is given; got prob ", prob.describe(),
              " and dprob ", dprob.describe());
  if (prob.defined()) {
    check_tensor(prob, DType::f32, {tokens, topk}, op, "prob");
    check_tensor(dprob, DType::f32, {tokens, topk}, op, "dprob");
    check_tensor(expert_out, dy.dtype(), {plan.capacity(), dy.cols()}, op, "expert_out");
  }
  const Device device = plan_device(
      plan, {&dy, &d_expert_out, optional(prob), optional(dprob), optional(expert_out)}, op);
  dispatch(
      device, op,
      [&] { cpu::moe_combine_backward(dy, expert_out, prob, plan, d_expert_out, dprob); },
      [&] {
        OCTET_CUDA_ONLY(
            cuda::moe_combine_backward(dy, expert_out, prob, plan, d_expert_out, dprob));
      });
}

void moe_gather_row_probs(const Tensor& prob, const MoePlan& plan, const Tensor& row_prob) {
  constexpr const char* op = "moe_gather_row_probs";
  OCTET_CHECK(prob.defined() && prob.ndim() == 2, op, ": prob must be f32 [tokens, topk], got ",
              prob.describe());
  check_plan(plan, prob.size(0), prob.size(1), op);
  check_tensor(prob, DType::f32, {prob.size(0), prob.size(1)}, op, "prob");
  check_tensor(row_prob, DType::f32, {plan.capacity()}, op, "row_prob");
  const Device device = plan_device(plan, {&prob, &row_prob}, op);
  dispatch(
      device, op, [&] { cpu::moe_gather_row_probs(prob, plan, row_prob); },
      [&] { OCTET_CUDA_ONLY(cuda::moe_gather_row_probs(prob, plan, row_prob)); });
}

void moe_scatter_row_probs(const Tensor& d_row_prob, const MoePlan& plan, const Tensor& dprob) {
  constexpr const char* op = "moe_scatter_row_probs";
  OCTET_CHECK(dprob.defined() && dprob.ndim() == 2, op,
              ": dprob must be f32 [tokens, topk], got ", dprob.describe());
  check_plan(plan, dprob.size(0), dprob.size(1), op);
  check_tensor(dprob, DType::f32, {dprob.size(0), dprob.size(1)}, op, "dprob");
  check_tensor(d_row_prob, DType::f32, {plan.capacity()}, op, "d_row_prob");
  const Device device = plan_device(plan, {&d_row_prob, &dprob}, op);
  dispatch(
      device, op, [&] { cpu::moe_scatter_row_probs(d_row_prob, plan, dprob); },
      [&] { OCTET_CUDA_ONLY(cuda::moe_scatter_row_probs(d_row_prob, plan, dprob)); });
}

void moe_scaled_activation_forward(MoeActivation act, const Tensor& fc1, const Tensor& row_prob,
                                   const MoePlan& plan, const Tensor& bias, const Tensor& h,
                                   const MoeExpertCasts* casts) {
  constexpr const char* op = "moe_scaled_activation_forward";
  const int64_t f = check_scaled_activation(act, fc1, row_prob, plan, bias, op);
  OCTET_CHECK(h.defined() || casts != nullptr, op,
              ": h may be undefined only with FP8 casts of FC2's input, got neither");
  if (h.defined()) check_tensor(h, fc1.dtype(), {fc1.rows(), f}, op, "h");
  const Device device = plan_device(plan, {&fc1, &row_prob, optional(bias), optional(h)}, op);
  if (casts != nullptr) check_expert_casts(*casts, plan, f, fc1, op);
  if (casts != nullptr && device.is_cuda()) {
    dispatch(
        device, op, [] {},
        [&] {
          OCTET_CUDA_ONLY(
              cuda::moe_scaled_activation_forward_cast(act, fc1, row_prob, plan, bias, h, *casts));
        });
    return;
  }
  // The CPU reference of the fused cast: each expert's rows of the finished h quantized with its
  // own target, which is the unfused path itself.
  const Tensor out = h.defined() ? h : Tensor::empty({fc1.rows(), f}, fc1.dtype(), device);
  dispatch(
      device, op, [&] { cpu::moe_scaled_activation_forward(act, fc1, row_prob, plan, bias, out); },
      [&] {
        OCTET_CUDA_ONLY(cuda::moe_scaled_activation_forward(act, fc1, row_prob, plan, bias, out));
      });
  if (casts == nullptr) return;
  for (size_t e = 0; e + 1 < casts->offsets.size(); ++e) {
    const int64_t begin = casts->offsets[e], end = casts->offsets[e + 1];
    if (end > begin) quantize(out.slice(begin, end), *casts->experts[e].out, casts->experts[e].args);
  }
}

void moe_scaled_activation_backward(MoeActivation act, const Tensor& dh, const Tensor& fc1,
                                    const Tensor& row_prob, const MoePlan& plan,
                                    const Tensor& bias, const Tensor& dfc1,
                                    const Tensor& d_row_prob, const Tensor& dbias) {
  constexpr const char* op = "moe_scaled_activation_backward";
  const int64_t f = check_scaled_activation(act, fc1, row_prob, plan, bias, op);
  check_tensor(dh, fc1.dtype(), {fc1.rows(), f}, op, "dh");
  check_tensor(dfc1, fc1.dtype(), fc1.shape(), op, "dfc1");
  check_tensor(d_row_prob, DType::f32, {fc1.rows()}, op, "d_row_prob");
  OCTET_CHECK(bias.defined() == dbias.defined(), op,
              ": dbias is written exactly when bias is given; got bias ", bias.describe(),
              " and dbias ", dbias.describe());
  if (dbias.defined()) check_tensor(dbias, DType::f32, bias.shape(), op, "dbias");
  const Device device = plan_device(
      plan, {&dh, &fc1, &row_prob, &dfc1, &d_row_prob, optional(bias), optional(dbias)}, op);
  dispatch(
      device, op,
      [&] {
        cpu::moe_scaled_activation_backward(act, dh, fc1, row_prob, plan, bias, dfc1, d_row_prob,
                                             dbias);
      },
      [&] {
        OCTET_CUDA_ONLY(cuda::moe_scaled_activation_backward(act, dh, fc1, row_prob, plan, bias,
                                                             dfc1, d_row_prob, dbias));
      });
}

}  // namespace octet::ops
