// octet::ops::grouped_gemm: per-group checks (the dense GEMM's, naming the group), the row ranges
// of expert-contiguous buffers, then one dispatch by device (src/ops/grouped_gemm_backend.h).
#include "octet/ops/grouped_gemm.h"

#include <optional>
#include <string>
#include <vector>

#include "ops/byte_ranges.h"
#include "ops/dispatch.h"
#include "ops/grouped_gemm_backend.h"

namespace octet::ops {
namespace {

void check_offsets(std::span<const int64_t> offsets, size_t groups, const char* op) {
  OCTET_CHECK(offsets.size() == groups + 1, op, ": expected ", groups + 1,
              " group offsets (one more than the ", groups, " groups), got ", offsets.size());
  OCTET_CHECK(offsets[0] == 0, op, ": group offsets must start at 0, got ", offsets[0]);
  for (size_t g = 0; g < groups; ++g) {
    OCTET_CHECK(offsets[g + 1] >= offsets[g], op, ": group offsets must not decrease, got offset ",
                offsets[g + 1], " for the end of group ", g, " after ", offsets[g]);
  }
}

bool has_elements(const GemmOperand& x) { return x.data.defined() && x.data.numel() > 0; }

/// Checks one problem as ops::gemm does; the message names the group.
GemmShape check_problem(const GemmProblem& p, size_t g) {
  try {
    return check_gemm_args(p.a, p.b, p.d, p.args);
  } catch (const Error& e) {
    OCTET_ERROR("grouped_gemm: group ", g, ": ", e.what());
  }
}

/// A group with nothing to sum over (K = 0): D = beta * D with beta 0 or 1.
void check_empty_inner(const GemmProblem& p, size_t g) {
  OCTET_CHECK(!p.args.bias.defined() && !p.args.addend.defined(), "grouped_gemm: group ", g,
              " has an empty inner dimension (no rows to sum over) but a bias or addend; expected "
              "neither for such a group");
  OCTET_CHECK(p.args.beta == 0.0f || p.args.beta == 1.0f, "grouped_gemm: group ", g,
              " has an empty inner dimension, which needs beta 0 (zero D) or 1 (keep D), got beta ",
              p.args.beta);
}

void check_on(const Device& device, const Tensor& t, size_t g, const char* what) {
  if (!t.defined()) return;
  OCTET_CHECK(t.device() == device, "grouped_gemm: all groups must be on one device (", device,
              "), got group ", g, "'s ", what, " ", t.describe());
}

GemmArgs group_args(const GroupedGemmArgs& args, size_t g) {
  GemmArgs out;
  out.alpha = args.alpha;
  out.beta = args.beta;
  out.accumulation = args.accumulation;
  if (!args.bias.empty()) out.bias = args.bias[g];
  return out;
}

/// One operand per group: the caller's, or the row ranges of one operand over all rows.
std::vector<GemmOperand> per_group(std::span<const GemmOperand> x, size_t groups,
                                   std::span<const int64_t> offsets, const char* name) {
  OCTET_CHECK(x.size() == groups || x.size() == 1, "grouped_gemm: operand ", name,
              ": expected one operand per group (", groups, ") or one over all rows, got ",
              x.size());
  if (x.size() == groups) return std::vector<GemmOperand>(x.begin(), x.end());
  return split_rows(x[0], offsets);
}

/// Throws when a group's D overlaps another group's D or anything it reads: the groups may run
/// in any order, or at once.
void check_independent(std::span<const GemmProblem> work) {
  std::vector<ByteRange> written;
  for (size_t g = 0; g < work.size(); ++g) written.push_back(byte_range(work[g].d, g));
  if (const auto pair = sort_and_find_overlap(written))
    OCTET_ERROR("grouped_gemm: groups ", pair->first.entry, " and ", pair->second.entry,
                " write overlapping memory; the groups must be independent");
  for (size_t g = 0; g < work.size(); ++g) {
    const GemmProblem& p = work[g];
    for (const Tensor* t : {&p.a.data, &p.a.scale_inv, &p.b.data, &p.b.scale_inv, &p.args.bias,
                            &p.args.addend}) {
      if (!t->defined() || t->nbytes() == 0) continue;
      const auto [first, last] = overlapping(written, byte_range(*t, g));
      for (auto w = first; w != last; ++w)
        OCTET_CHECK(w->entry == g, "grouped_gemm: group ", w->entry, " writes memory that group ",
                    g, " reads; the groups must be independent");
    }
  }
}

}  // namespace

void grouped_gemm(std::span<const GemmProblem> problems) {
  std::vector<GemmProblem> work;
  std::vector<GemmShape> shapes;
  std::vector<Tensor> cleared;
  std::optional<Device> device;
  for (size_t g = 0; g < problems.size(); ++g) {
    const GemmProblem& p = problems[g];
    OCTET_CHECK(p.d.defined(), "grouped_gemm: group ", g, "'s output D is an undefined tensor");
    if (!device) device = p.d.device();
    for (const Tensor* t : {&p.a.data, &p.a.scale_inv, &p.b.data, &p.b.scale_inv, &p.d,
                            &p.args.bias, &p.args.addend}) {
      check_on(*device, *t, g, "tensor");
    }
    if (p.d.numel() == 0) continue;  // an empty group: nothing to write
    if (!has_elements(p.a) || !has_elements(p.b)) {
      check_empty_inner(p, g);
      if (p.args.beta == 0.0f) cleared.push_back(p.d);
      continue;
    }
    shapes.push_back(check_problem(p, g));
    work.push_back(p);
  }
  check_independent(work);
  for (Tensor& d : cleared) d.zero();
  if (work.empty()) return;
  const GemmProblem& first = work.front();
  const std::string label =
      op_label("grouped_gemm", work.size(), " groups ", dtype_name(first.a.data.dtype()), "x",
               dtype_name(first.b.data.dtype()), "->", dtype_name(first.d.dtype()));
  dispatch(
      *device, label.c_str(), [&] { cpu::grouped_gemm(work, shapes); },
      [&] { OCTET_CUDA_ONLY(cuda::grouped_gemm(work, shapes)); });
}

void grouped_gemm(std::span<const GemmOperand> a, std::span<const GemmOperand> b, const Tensor& d,
                  std::span<const int64_t> offsets, const GroupedGemmArgs& args) {
  const size_t groups = b.size();
  check_offsets(offsets, groups, "grouped_gemm");
  OCTET_CHECK(d.defined() && d.ndim() == 2 && d.rows() == offsets[groups],
              "grouped_gemm: D must be the [", offsets[groups],
              ", N] expert-contiguous output (the offsets' last entry is its rows), got ",
              d.defined() ? d.describe() : std::string("an undefined tensor"));
  OCTET_CHECK(args.bias.empty() || args.bias.size() == groups, "grouped_gemm: expected no bias or ",
              groups, " (one per group), got ", args.bias.size());
  const std::vector<GemmOperand> a_groups = per_group(a, groups, offsets, "A");
  std::vector<GemmProblem> problems;
  for (size_t g = 0; g < groups; ++g) {
    if (offsets[g + 1] == offsets[g]) continue;  // an empty expert
    problems.push_back({a_groups[g], b[g], d.slice(offsets[g], offsets[g + 1]), group_args(args, g)});
  }
  grouped_gemm(problems);
}

void grouped_gemm_wgrad(std::span<const GemmOperand> a, std::span<const GemmOperand> b,
                        std::span<const Tensor> d, std::span<const int64_t> offsets,
                        const GroupedGemmArgs& args) {
  const size_t groups = d.size();
  check_offsets(offsets, groups, "grouped_gemm_wgrad");
  OCTET_CHECK(args.bias.empty(), "grouped_gemm_wgrad: a weight gradient takes no bias, got ",
              args.bias.size());
  const std::vector<GemmOperand> a_groups = per_group(a, groups, offsets, "A");
  const std::vector<GemmOperand> b_groups = per_group(b, groups, offsets, "B");
  std::vector<GemmProblem> problems;
  for (size_t g = 0; g < groups; ++g) {
    problems.push_back({a_groups[g], b_groups[g], d[g], group_args(args, g)});
  }
  grouped_gemm(problems);
}

std::vector<GemmOperand> split_rows(const GemmOperand& whole, std::span<const int64_t> offsets) {
  OCTET_CHECK(whole.data.defined() && whole.data.ndim() >= 1, "split_rows: expected an operand "
              "with data, got ", whole.data.defined() ? whole.data.describe() : "none");
  const size_t groups = offsets.size() - 1;
  check_offsets(offsets, groups, "split_rows");
  const int64_t rows = whole.data.rows();
  OCTET_CHECK(offsets[groups] == rows, "split_rows: the offsets cover ", offsets[groups],
              " rows but the operand has ", rows, " (", whole.data.describe(), ")");
  const bool fp8 = is_fp8(whole.data.dtype());
  OCTET_CHECK(!fp8 || whole.mode != fp8::ScalingMode::block_128x128,
              "split_rows: 128x128 block scales cover 128 rows each and cannot be split at "
              "arbitrary group offsets; quantize each group on its own");
  const Tensor data = whole.data.view({rows, whole.data.cols()});
  std::vector<GemmOperand> parts(groups, whole);
  for (size_t g = 0; g < groups; ++g) {
    parts[g].data = data.slice(offsets[g], offsets[g + 1]);
    // 1x128 and MXFP8 scales are [rows, blocks]: a row range of them goes with the data's rows.
    if (fp8 && whole.mode != fp8::ScalingMode::per_tensor) {
      parts[g].scale_inv = whole.scale_inv.slice(offsets[g], offsets[g + 1]);
    }
  }
  return parts;
}

std::string grouped_gemm_path(const Device& device) {
  if (device.is_cpu()) return "cpu: the reference GEMM once per group";
#if OCTET_WITH_CUDA
  return cuda::grouped_gemm_path(device);
#else
  OCTET_ERROR("grouped_gemm_path: ", device, " needs the CUDA backend, but octet was built "
              "without CUDA");
#endif
}

}  // namespace octet::ops
