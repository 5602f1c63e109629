#include "octet/nn/grouped_linear.h"

#include <algorithm>
#include <string>

#include "octet/core/hash.h"
#include "octet/nn/autocast.h"
#include "octet/ops/grouped_gemm.h"

namespace octet::nn {
namespace {

/// While alive, the experts' GEMMs go to `queue` (Linear::defer_gemms); an exception leaves no
/// expert deferring into a queue that is gone.
class DeferredGemms {
 public:
  explicit DeferredGemms(std::vector<Linear>& experts) : experts_(experts) {
    for (Linear& e : experts_) e.defer_gemms(&queue_);
  }
  ~DeferredGemms() {
    for (Linear& e : experts_) e.defer_gemms(nullptr);
  }
  DeferredGemms(const DeferredGemms&) = delete;
  DeferredGemms& operator=(const DeferredGemms&) = delete;
  /// Runs every gathered GEMM as one grouped GEMM.
  void run() {
    ops::grouped_gemm(queue_);
    queue_.clear();
  }

 private:
  std::vector<Linear>& experts_;
  std::vector<ops::GemmProblem> queue_;
};

bool has_rows(std::span<const int64_t> offsets, size_t g) { return offsets[g + 1] > offsets[g]; }

/// The experts' FP8 casts of `role` under `recipe`, [rows[g], cols] each with both copies (none
/// where rows[g] is 0), carved from one allocation per copy: per-expert allocations cost the FP8
/// MoE step host time on every pass.
std::vector<fp8::QuantizedTensor> expert_casts(std::span<const int64_t> rows, int64_t cols,
                                               const fp8::Recipe& recipe, fp8::TensorRole role,
                                               const Device& device) {
  return fp8::QuantizedTensor::allocate_groups(rows, cols, recipe.dtype_for(role),
                                               recipe.mode_for(role),
                                               fp8::Usage{.rowwise = true, .columnwise = true},
                                               device);
}

/// Each expert's row count.
std::vector<int64_t> group_rows(std::span<const int64_t> offsets) {
  std::vector<int64_t> rows(offsets.size() - 1);
  for (size_t g = 0; g < rows.size(); ++g) rows[g] = offsets[g + 1] - offsets[g];
  return rows;
}

}  // namespace

GroupedLinear::Saved GroupedLinear::Saved::snapshot_only() const {
  Saved out;
  out.offsets = offsets;
  out.input_dtype = input_dtype;
  for (const Linear::Saved& e : experts) {
    out.experts.push_back(e.snapshot.weight ? Linear::Saved::from_snapshot(e.snapshot)
                                            : Linear::Saved{});
  }
  return out;
}

void GroupedLinear::Saved::release_forward_only() {
  for (Linear::Saved& e : experts) e.release_forward_only();
}

uint64_t GroupedLinear::seed_of_expert(uint64_t seed, int64_t expert) {
  return mix64(seed ^ mix64(static_cast<uint64_t>(expert) + 1));
}

GroupedLinear::GroupedLinear(int64_t experts, int64_t in_features, int64_t out_features, bool bias,
                             const Device& device, uint64_t seed, DType compute_dtype)
    : in_(in_features), out_(out_features), device_(device) {
  OCTET_CHECK(experts > 0, "GroupedLinear needs at least one expert, got ", experts);
  experts_.reserve(static_cast<size_t>(experts));
  for (int64_t g = 0; g < experts; ++g) {
    experts_.emplace_back(in_features, out_features, bias, device, seed_of_expert(seed, g),
                          compute_dtype);
  }
}

void GroupedLinear::check_offsets(std::span<const int64_t> offsets) const {
  OCTET_CHECK(offsets.size() == experts_.size() + 1, "GroupedLinear(", experts_.size(),
              " experts) expects ", experts_.size() + 1, " group offsets, got ", offsets.size());
  OCTET_CHECK(offsets[0] == 0, "GroupedLinear: group offsets must start at 0, got ", offsets[0]);
  for (size_t g = 0; g < experts_.size(); ++g) {
    OCTET_CHECK(offsets[g + 1] >= offsets[g], "GroupedLinear: group offsets must not decrease, "
                "got ", offsets[g + 1], " after ", offsets[g], " (expert ", g, ")");
  }
}

std::optional<std::vector<ops::FusedQuantize>> GroupedLinear::fused_input(
    std::span<const int64_t> offsets, DType dtype, Saved& saved, ForwardMode mode) {
  check_offsets(offsets);
  const bool recompute = mode == ForwardMode::recompute;
  OCTET_CHECK(!recompute || saved.experts.size() == experts_.size(),
              "GroupedLinear::fused_input(recompute) needs the snapshot of the original forward "
              "(Saved::snapshot_only), got a record of ", saved.experts.size(), " experts");
  std::vector<Linear::Saved> records(experts_.size());
  if (recompute) records = std::move(saved.experts);
  for (size_t g = 0; g < experts_.size(); ++g) {
    if (has_rows(offsets, g) && !experts_[g].takes_fused_input(records[g], mode)) {
      if (recompute) saved.experts = std::move(records);
      return std::nullopt;
    }
  }
  saved.offsets.assign(offsets.begin(), offsets.end());
  saved.input_dtype = dtype;
  saved.experts = std::move(records);
  std::vector<ops::FusedQuantize> targets(experts_.size());
  const std::vector<int64_t> rows = group_rows(offsets);
  const auto first = std::find_if(rows.begin(), rows.end(), [](int64_t r) { return r > 0; });
  if (first == rows.end()) return targets;
  // One forward's experts share its recipe: the active one, or the snapshot's when recomputing.
  const size_t first_expert = static_cast<size_t>(first - rows.begin());
  const fp8::Recipe recipe =
      recompute ? saved.experts[first_expert].snapshot.recipe : active_fp8()->recipe;
  std::vector<fp8::QuantizedTensor> casts =
      expert_casts(rows, in_, recipe, fp8::TensorRole::input, device_);
  for (size_t g = 0; g < experts_.size(); ++g) {
    if (rows[g] == 0) continue;
    targets[g] = *experts_[g].fused_input(rows[g], dtype, saved.experts[g], mode,
                                          std::move(casts[g]));
  }
  return targets;
}

Tensor GroupedLinear::forward(const Tensor& x, std::span<const int64_t> offsets, Saved& saved,
                              ForwardMode mode, int64_t fused_rows) {
  check_offsets(offsets);
  bool prefilled = saved.offsets.size() == offsets.size() && !saved.experts.empty() &&
                   std::any_of(saved.experts.begin(), saved.experts.end(),
                               [](const Linear::Saved& e) { return e.input_prefilled; });
  const int64_t grouped = offsets.back();
  const int64_t rows = x.defined() ? x.rows() : std::max(fused_rows, grouped);
  if (x.defined()) {
    OCTET_CHECK(x.ndim() == 2 && x.rows() >= grouped && x.cols() == in_ &&
                    is_high_precision(x.dtype()) && x.device() == device_,
                "GroupedLinear(in=", in_, ") on ", device_, " expects x [rows >= ", grouped, ", ",
                in_, "] f32 or bf16 there (the offsets' last entry; rows past it are padding), "
                "got ", x.describe());
  } else {
    OCTET_CHECK(prefilled, "GroupedLinear::forward: x is undefined, which needs a fused input "
                "(fused_input)");
  }
  OCTET_CHECK(mode != ForwardMode::recompute || saved.experts.size() == experts_.size(),
              "GroupedLinear::forward(recompute) needs the snapshot of the original forward "
              "(Saved::snapshot_only), got a record of ", saved.experts.size(), " experts");
  // Every expert's input cast in one grouped quantize, when all of them can take one (the same
  // casts as their own forwards: a launch for the layer instead of one per expert).
  if (x.defined() && !prefilled && grouped > 0) {
    if (const auto targets = fused_input(offsets, x.dtype(), saved, mode)) {
      ops::quantize_groups(x, offsets, *targets);
      prefilled = true;
    }
  }
  const DType dtype = x.defined() ? x.dtype() : saved.input_dtype;
  if (saved.experts.size() != experts_.size()) saved.experts.assign(experts_.size(), {});
  saved.offsets.assign(offsets.begin(), offsets.end());
  saved.input_dtype = dtype;

  Tensor y = Tensor::empty({rows, out_}, dtype, device_);
  if (rows > grouped) y.slice(grouped, rows).zero();
  DeferredGemms gemms(experts_);
  for (size_t g = 0; g < experts_.size(); ++g) {
    if (!has_rows(offsets, g)) {
      saved.experts[g] = Linear::Saved{};
      continue;
    }
    const Tensor xg = x.defined() ? x.slice(offsets[g], offsets[g + 1]) : Tensor();
    experts_[g].forward_into(xg, y.slice(offsets[g], offsets[g + 1]), saved.experts[g], mode);
  }
  gemms.run();
  return y;
}

Tensor GroupedLinear::backward(const Tensor& dy, const Saved& saved) {
  OCTET_CHECK(saved.experts.size() == experts_.size() &&
                  saved.offsets.size() == experts_.size() + 1,
              "GroupedLinear::backward needs the Saved of a forward (or of a recompute), got a "
              "record of ", saved.experts.size(), " experts");
  const std::span<const int64_t> offsets = saved.offsets;
  const int64_t grouped = offsets.back();
  OCTET_CHECK(dy.defined() && dy.ndim() == 2 && dy.rows() >= grouped && dy.cols() == out_,
              "GroupedLinear::backward expects grad_output [rows >= ", grouped, ", ", out_,
              "], got ", dy.defined() ? dy.describe() : std::string("an undefined tensor"));
  const int64_t rows = dy.rows();
  Tensor dx = Tensor::empty({rows, in_}, saved.input_dtype, device_);
  if (rows > grouped) dx.slice(grouped, rows).zero();
  // The grad_output casts of the experts that can take a fused one go in one grouped quantize;
  // the rest (a first delayed pass, BF16, other recipes) cast in their own backward.
  std::vector<int64_t> fused_rows = group_rows(offsets);
  const fp8::Recipe* recipe = nullptr;
  for (size_t g = 0; g < experts_.size(); ++g) {
    if (fused_rows[g] == 0) continue;
    if (experts_[g].takes_fused_grad_output(saved.experts[g])) {
      recipe = &saved.experts[g].snapshot.recipe;
    } else {
      fused_rows[g] = 0;
    }
  }
  std::vector<fp8::QuantizedTensor> dy_q =
      recipe != nullptr
          ? expert_casts(fused_rows, out_, *recipe, fp8::TensorRole::grad_output, device_)
          : std::vector<fp8::QuantizedTensor>(experts_.size());
  std::vector<ops::FusedQuantize> casts(experts_.size());
  for (size_t g = 0; g < experts_.size(); ++g) {
    if (fused_rows[g] == 0) continue;
    casts[g] = *experts_[g].fused_grad_output(fused_rows[g], saved.experts[g], dy_q[g]);
  }
  ops::quantize_groups(dy, offsets, casts);
  DeferredGemms gemms(experts_);
  for (size_t g = 0; g < experts_.size(); ++g) {
    if (!has_rows(offsets, g)) continue;
    const Tensor dx_g = dx.slice(offsets[g], offsets[g + 1]);
    if (casts[g].out != nullptr) {
      experts_[g].backward_into(dy_q[g], dx_g, saved.experts[g]);
    } else {
      experts_[g].backward_into(dy.slice(offsets[g], offsets[g + 1]), dx_g, saved.experts[g]);
    }
  }
  gemms.run();
  return dx;
}

void GroupedLinear::zero_grad(ZeroGrad how) {
  for (Linear& e : experts_) e.zero_grad(how);
}

void GroupedLinear::settle_grad() {
  for (Linear& e : experts_) e.settle_grad();
}

void GroupedLinear::on_weights_updated(PreparedCast prepared) {
  for (Linear& e : experts_) e.on_weights_updated(prepared);
}

}  // namespace octet::nn
