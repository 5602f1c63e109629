// Dispatcher of the copy family: validates the lists (messages name the entry at fault), then
// runs the backend of the tensors' device through dispatch() (device guard + NVTX range).
#include "octet/ops/copy.h"

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <vector>

#include "ops/copy_backend.h"
#include "ops/dispatch.h"

namespace octet::ops {
namespace {

constexpr const char* kOp = "copy_tensors";

/// An entry of one of the lists as messages name it, "src[3]" or "dst[3]". Streamed only when a
/// check fails, so validating hundreds of pairs every step builds no strings.
struct EntryName {
  const char* list;
  size_t index;
};

std::ostream& operator<<(std::ostream& out, const EntryName& name) {
  return out << name.list << "[" << name.index << "]";
}

/// Throws unless pair `i` is defined, of one dtype and element count, on `device`.
void check_pair(const Tensor& src, const Tensor& dst, size_t i, const Device& device) {
  const EntryName src_name{"src", i}, dst_name{"dst", i};
  OCTET_CHECK(src.defined(), kOp, ": ", src_name, " is an undefined tensor");
  OCTET_CHECK(dst.defined(), kOp, ": ", dst_name, " is an undefined tensor");
  OCTET_CHECK(src.dtype() == dst.dtype(), kOp, ": dtype mismatch: ", dst_name, " is ",
              dst.describe(), " but ", src_name, " is ", src.describe(), "; expected one dtype");
  OCTET_CHECK(src.numel() == dst.numel(), kOp, ": ", dst_name, " holds ", dst.numel(),
              " elements but ", src_name, " holds ", src.numel(), " (", src.describe(), " vs ",
              dst.describe(), ")");
  for (const auto& [t, name] : {std::pair{&src, src_name}, std::pair{&dst, dst_name}})
    OCTET_CHECK(t->device() == device, kOp, ": all tensors must be on one device, got src[0] on ",
                device, " and ", name, " ", t->describe());
}

/// The bytes of one tensor of the lists.
struct Range {
  uintptr_t begin, end;
  size_t index;
};

Range range_of(const Tensor& t, size_t index) {
  const auto begin = reinterpret_cast<uintptr_t>(t.raw_data());
  return {begin, begin + t.nbytes(), index};
}

/// Throws if a dst overlaps another dst or any src: every pair is copied at once, so what an
/// overlapping pair would read or leave behind would depend on the schedule. Sources may overlap
/// each other (they are only read).
void check_no_overlap(std::span<const Tensor> src, std::span<const Tensor> dst) {
  std::vector<Range> written;
  written.reserve(dst.size());
  for (size_t i = 0; i < dst.size(); ++i)
    if (dst[i].nbytes() > 0) written.push_back(range_of(dst[i], i));
  // Stable, so a message about ranges that start together names them in the order given.
  std::stable_sort(written.begin(), written.end(),
                   [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < written.size(); ++k) {
    const Range &a = written[k - 1], &b = written[k];
    OCTET_CHECK(b.begin >= a.end, kOp, ": ", EntryName{"dst", b.index}, " overlaps ",
                EntryName{"dst", a.index}, " in memory; every tensor written must appear once");
  }
  // The dst ranges are now disjoint and sorted, so their ends are sorted too: the last one that
  // begins before a source ends is the only one that can reach into it.
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i].nbytes() == 0) continue;
    const Range read = range_of(src[i], i);
    auto after = std::partition_point(written.begin(), written.end(),
                                      [&](const Range& w) { return w.begin < read.end; });
    if (after == written.begin()) continue;
    const Range& w = *(after - 1);
    OCTET_CHECK(w.end <= read.begin, kOp, ": ", EntryName{"dst", w.index}, " overlaps ",
                EntryName{"src", read.index}, " in memory; a copy's destination must not share ",
                "bytes with any source");
  }
}

}  // namespace

void copy_tensors(std::span<const Tensor> src, std::span<const Tensor> dst) {
  OCTET_CHECK(src.size() == dst.size(), kOp, ": src holds ", src.size(), " tensors but dst holds ",
              dst.size(), "; expected one dst per src");
  if (src.empty()) return;
  OCTET_CHECK(src[0].defined(), kOp, ": ", EntryName{"src", 0}, " is an undefined tensor");
  const Device device = src[0].device();
  for (size_t i = 0; i < src.size(); ++i) check_pair(src[i], dst[i], i, device);
  check_no_overlap(src, dst);
  const std::string label = op_label(kOp, src.size(), " tensors");
  dispatch(
      device, label.c_str(), [&] { cpu::copy_tensors(src, dst); },
      [&] { OCTET_CUDA_ONLY(cuda::copy_tensors(src, dst)); });
}

}  // namespace octet::ops
