// Backend entry points of the grouped GEMM family (include/octet/ops/grouped_gemm.h); see
// quantize_backend.h for the contract between dispatcher and backends. The dispatcher has checked
// every problem (check_gemm_args) and dropped the ones with nothing to multiply.
#pragma once

#include <span>
#include <string>

#include "octet/ops/grouped_gemm.h"
#include "ops/gemm_backend.h"

namespace octet::ops::cpu {
void grouped_gemm(std::span<const GemmProblem> problems, std::span<const GemmShape> shapes);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void grouped_gemm(std::span<const GemmProblem> problems, std::span<const GemmShape> shapes);
/// The capability probe's answer for `device`, and the path it chose (grouped_gemm_path).
std::string grouped_gemm_path(const Device& device);
}  // namespace octet::ops::cuda
