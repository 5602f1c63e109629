// CUDA grouped GEMM. cuBLASLt's grouped matmul (one launch for every group, shapes in device
// arrays) is used only where the loaded library offers it; the probe below asks the library
// itself, never its version. Otherwise each group is one cuBLASLt call through the dense GEMM's
// planner (cublaslt.h): every group runs the algorithm the dense GEMM runs for its shape, so its
// result is bitwise ops::gemm's, and the determinism filter (no in-place split-K) holds for every
// group, wgrad included. The calls are spread round-robin over kGemmLanes streams, each with its
// own workspace, forked from and joined back into octet's stream: a 1024-row expert GEMM fills a
// fraction of the SMs, and several in flight fill the rest. Groups whose GEMM needs a temporary
// from the pool (block or MXFP8 scales, FP32 operands with a BF16 D) run on octet's stream.
#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

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

namespace {

/// The side lanes of one grouped GEMM: each waits for what octet's stream has queued before it
/// (the groups' inputs), and octet's stream waits for each of them when this ends, also when a
/// group threw, so nothing the groups read or write is freed or reused while they run.
class LaneFork {
 public:
  LaneFork(const Device& device, int lanes) : device_(device), lanes_(lanes) {
    for (int l = 1; l < lanes_; ++l) side_[l] = gemm_lane(device, l).stream;
    const cudaEvent_t forked = octet::cuda::record_event(device);
    for (int l = 1; l < lanes_; ++l) OCTET_CHECK_CUDA(cudaStreamWaitEvent(side_[l], forked, 0));
    OCTET_CHECK_CUDA(cudaEventDestroy(forked));
  }
  ~LaneFork() {  // a destructor cannot throw: a failed join call is left to the next CUDA check
    DeviceGuard guard(device_);
    for (int l = 1; l < lanes_; ++l) {
      cudaEvent_t done = nullptr;
      cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
      cudaEventRecord(done, side_[l]);
      cudaStreamWaitEvent(octet::cuda::stream(device_), done, 0);
      cudaEventDestroy(done);
    }
  }
  LaneFork(const LaneFork&) = delete;
  LaneFork& operator=(const LaneFork&) = delete;

 private:
  Device device_;
  int lanes_;
  cudaStream_t side_[kGemmLanes] = {};
};

}  // namespace

void grouped_gemm(std::span<const GemmProblem> problems, std::span<const GemmShape> shapes) {
  std::vector<size_t> on_lanes, on_stream;  // the groups that may run on any lane, and the rest
  for (size_t i = 0; i < problems.size(); ++i)
    (runs_on_any_lane(problems[i].a, problems[i].b, problems[i].d) ? on_lanes : on_stream)
        .push_back(i);
  const int lanes = static_cast<int>(std::min<size_t>(kGemmLanes, on_lanes.size()));
  if (lanes > 1) {
    const Device device = problems[on_lanes[0]].d.device();
    DeviceGuard guard(device);
    const LaneFork fork(device, lanes);
    for (size_t k = 0; k < on_lanes.size(); ++k) {
      const GemmProblem& p = problems[on_lanes[k]];
      gemm_on_lane(static_cast<int>(k % lanes), p.a, p.b, p.d, p.args, shapes[on_lanes[k]]);
    }
  } else {
    on_stream.insert(on_stream.end(), on_lanes.begin(), on_lanes.end());
  }
  for (const size_t i : on_stream) {
    const GemmProblem& p = problems[i];
    gemm(p.a, p.b, p.d, p.args, shapes[i]);
  }
}

}  // namespace octet::ops::cuda
