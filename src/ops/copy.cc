// Dispatcher of the copy family: validates the lists (messages name the entry at fault), then
// runs the backend of the tensors' device through dispatch() (device guard + NVTX range).
#include "octet/ops/copy.h"

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <vector>

#include "ops/byte_ranges.h"
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

/// Throws if a dst overlaps another dst or any src: every pair is copied at once, so what an
/// overlapping pair would read or leave behind would depend on the schedule. Sources may overlap
/// each other (they are only read).
void check_no_overlap(std::span<const Tensor> src, std::span<const Tensor> dst) {
  std::vector<ByteRange> written;
  written.reserve(dst.size());
  for (size_t i = 0; i < dst.size(); ++i)
    if (dst[i].nbytes() > 0) written.push_back(byte_range(dst[i], i));
  if (const auto pair = sort_and_find_overlap(written))
    OCTET_ERROR(kOp, ": ", EntryName{"dst", pair->second.entry}, " overlaps ",
                EntryName{"dst", pair->first.entry},
                " in memory; every tensor written must appear once");
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i].nbytes() == 0) continue;
    const auto [first, last] = overlapping(written, byte_range(src[i], i));
    OCTET_CHECK(first == last, kOp, ": ", EntryName{"dst", first->entry}, " overlaps ",
                EntryName{"src", i}, " in memory; a copy's destination must not share ",
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
