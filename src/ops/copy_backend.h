// Backend entry points of the copy family (include/octet/ops/copy.h); see quantize_backend.h for
// the contract between dispatcher and backends. Here: a non-empty list of pairs of one dtype and
// element count each, all on one device, no dst overlapping a dst or a src.
#pragma once

#include <cstdint>
#include <span>

#include "octet/ops/copy.h"

namespace octet::ops {

/// Pairs per launch of the CUDA kernel, which takes its list by value in its parameters: 28 bytes
/// a pair, ~14 KB in all (under the 32,764-byte limit, launch_util.cuh), so the ~300 FP8 state
/// tensors of GPT-2 124M (scale, scale_inv and amax history of both passes, ~50 states) take one
/// launch. A longer list takes ceil(pairs / kCopyMaxPairsPerLaunch) launches.
inline constexpr int kCopyMaxPairsPerLaunch = 512;
/// Bytes per CTA of the CUDA kernel: 8 16-byte words per thread of 256, enough in flight to
/// stream a large tensor at bandwidth while a small one (an FP8 scale, an amax history) still
/// takes a single CTA.
inline constexpr int64_t kCopyChunkBytes = 8 * 16 * 256;

}  // namespace octet::ops

namespace octet::ops::cpu {
void copy_tensors(std::span<const Tensor> src, std::span<const Tensor> dst);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void copy_tensors(std::span<const Tensor> src, std::span<const Tensor> dst);
}  // namespace octet::ops::cuda
