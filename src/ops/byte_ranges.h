// The memory ranges of tensors, for the dispatchers that refuse lists whose written tensors
// overlap (copy_tensors, grouped_gemm, the multi-tensor adamw_step): their backends write every
// entry at once, so an overlap would make the result depend on the schedule.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "octet/core/tensor.h"

namespace octet::ops {

/// The bytes a tensor's storage spans, tagged with the list entry it belongs to.
struct ByteRange {
  uintptr_t begin = 0, end = 0;
  size_t entry = 0;
};

inline ByteRange byte_range(const Tensor& t, size_t entry) {
  const auto begin = reinterpret_cast<uintptr_t>(t.raw_data());
  return {begin, begin + t.nbytes(), entry};
}

/// Sorts `written` by address (stably: ranges that start together keep the order given) and
/// returns the first two neighbours that overlap, earlier one first; nullopt when all are
/// disjoint, after which `written` is sorted by its ends too.
inline std::optional<std::pair<ByteRange, ByteRange>> sort_and_find_overlap(
    std::vector<ByteRange>& written) {
  std::stable_sort(written.begin(), written.end(),
                   [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < written.size(); ++k)
    if (written[k].begin < written[k - 1].end) return std::pair{written[k - 1], written[k]};
  return std::nullopt;
}

/// The written ranges that overlap `read`, for `written` sorted and disjoint (after
/// sort_and_find_overlap found no overlap): the run from the first one that ends after `read`
/// begins to the last one that begins before it ends.
inline std::pair<std::vector<ByteRange>::const_iterator, std::vector<ByteRange>::const_iterator>
overlapping(const std::vector<ByteRange>& written, const ByteRange& read) {
  const auto first = std::partition_point(written.begin(), written.end(),
                                          [&](const ByteRange& w) { return w.end <= read.begin; });
  const auto last = std::partition_point(first, written.end(),
                                         [&](const ByteRange& w) { return w.begin < read.end; });
  return {first, last};
}

}  // namespace octet::ops
