// A binary search that host and device code share: which group of a partition an index falls in.
#pragma once

#include <cstdint>

#include "octet/fp8/format.h"  // OCTET_HD

namespace octet::ops {

/// The last i in [0, count) with starts[i] <= value, for non-decreasing starts with starts[0] <=
/// value: the group of a partition whose groups begin at starts[0..count) that holds `value`
/// (with empty groups, the last of those that begin at the same place).
template <typename Start, typename Value>
OCTET_HD int64_t last_start_at_most(const Start* starts, int64_t count, Value value) {
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (starts[mid] <= value) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace octet::ops
