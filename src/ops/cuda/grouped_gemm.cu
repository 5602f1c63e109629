// CUDA grouped GEMM. cuBLASLt's grouped matmul (one launch for every group, shapes in device
// arrays) is used only where the loaded library offers it; the probe below asks the library
// itself, never its version. Otherwise each group is one cuBLASLt call through the dense GEMM's
// planner (cublaslt.h), on octet's one stream for the device, in group order: every group then
// runs the algorithm the dense GEMM runs for its shape, so its result is bitwise ops::gemm's, and
// the determinism filter (no in-place split-K) holds for every group, wgrad included.
#include <cublasLt.h>
#include <dlfcn.h>

#include <map>
#include <mutex>
#include <string>

#include "octet/core/cuda_context.h"
#include "ops/cuda/cublaslt.h"
#include "ops/grouped_gemm_backend.h"

namespace octet::ops::cuda {
namespace {

/// The exported entry point behind cublasLtGroupedMatrixLayoutCreate/Init, the grouped layout
/// that cuBLASLt's grouped matmul is described with.
constexpr const char* kGroupedLayoutSymbol = "cublasLtGroupedMatrixLayoutInit_internal";

/// Whether the cuBLASLt this process loaded exports the grouped layout: the library that
/// defines cublasLtCreate is found by address and asked for the symbol.
bool loaded_cublaslt_exports_grouped_layout(std::string& library) {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&cublasLtCreate), &info) == 0 || info.dli_fname == nullptr)
    return false;
  library = info.dli_fname;
  void* handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return false;
  const bool found = dlsym(handle, kGroupedLayoutSymbol) != nullptr;
  dlclose(handle);
  return found;
}

/// The probe's answer, once per process (the library does not change while it runs).
std::string probe_grouped_matmul(const Device& device) {
  std::string library = "the cuBLASLt linked into this process";
  const bool exported = loaded_cublaslt_exports_grouped_layout(library);
  const std::string where = detail::concat(library, " on ", gpu_name(device));
  if (!exported) {
    return detail::concat("cuda: one cuBLASLt call per group through the dense planner; probe: ",
                          where, " exports no ", kGroupedLayoutSymbol,
                          ", so it has no grouped matmul for any dtype");
  }
  // The library has it, but this build's cublasLt.h declares none of it, so there is nothing
  // octet could call with a known signature.
  return detail::concat("cuda: one cuBLASLt call per group through the dense planner; probe: ",
                        where, " exports ", kGroupedLayoutSymbol,
                        ", but octet was compiled against a cublasLt.h without the grouped API; "
                        "rebuild against that cuBLAS to try it for FP8 and BF16");
}

}  // namespace

std::string grouped_gemm_path(const Device& device) {
  static std::mutex mutex;
  static std::map<int, std::string> answers;
  std::lock_guard lock(mutex);
  auto [it, fresh] = answers.try_emplace(device.index);
  if (fresh) it->second = probe_grouped_matmul(device);
  return it->second;
}

void grouped_gemm(std::span<const GemmProblem> problems, std::span<const GemmShape> shapes) {
  for (size_t i = 0; i < problems.size(); ++i) {
    const GemmProblem& p = problems[i];
    gemm(p.a, p.b, p.d, p.args, shapes[i]);
  }
}

}  // namespace octet::ops::cuda
