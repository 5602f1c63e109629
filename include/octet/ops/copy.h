// Multi-tensor copy: many small stream-ordered copies (a snapshot of every FP8 state) in one
// kernel launch instead of one launch per tensor.
#pragma once

#include <span>

#include "octet/core/tensor.h"

namespace octet::ops {

/// dst[i] = the bytes of src[i] for every i, on the tensors' device, in one kernel launch on CUDA
/// (a list too long for one launch's parameters takes a few), stream-ordered on octet's stream of
/// that device, with no host sync and no allocation. src and dst hold equally many tensors; each
/// pair has one dtype (any) and one element count (shapes may differ: octet tensors are
/// contiguous and row-major, so the bytes go in that order). Every tensor is defined and on one
/// device, and no dst overlaps another dst or any src in memory (all pairs are copied at once, so
/// an overlap would race). An empty list does nothing.
void copy_tensors(std::span<const Tensor> src, std::span<const Tensor> dst);

}  // namespace octet::ops
