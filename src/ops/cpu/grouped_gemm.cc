// CPU reference of the grouped GEMM: each group is the dense reference GEMM, in group order, so a
// group's result is bitwise ops::gemm's.
#include "ops/grouped_gemm_backend.h"

namespace octet::ops::cpu {

void grouped_gemm(std::span<const GemmProblem> problems, std::span<const GemmShape> shapes) {
  for (size_t i = 0; i < problems.size(); ++i) {
    const GemmProblem& p = problems[i];
    gemm(p.a, p.b, p.d, p.args, shapes[i]);
  }
}

}  // namespace octet::ops::cpu
