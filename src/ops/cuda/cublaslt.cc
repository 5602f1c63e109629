// Compiled only when OCTET_WITH_CUDA.
#include "ops/cuda/cublaslt.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <map>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "octet/core/allocator.h"
#include "octet/core/cuda_context.h"
#include "octet/fp8/quantized_tensor.h"

namespace octet::ops::cuda {

namespace {

/// A lane other than 0: a stream and a workspace of its own.
struct SideLane {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
};

/// Every device's cuBLASLt state (null until its first GEMM) and side lanes (null until a grouped
/// GEMM uses them), under the mutex.
struct CublasLtStates {
  std::mutex mutex;
  std::vector<CublasLt*> devices;
  std::vector<std::array<SideLane, kGemmLanes>> lanes;  ///< [device][lane], lane 0 unused
};

/// kCublasWorkspaceBytes on `device` from the pool, its start rounded up to the alignment
/// cuBLASLt expects; `raw` is the allocation itself.
void* aligned_workspace(const Device& device, void*& raw) {
  raw = device_alloc(kCublasWorkspaceBytes + kCublasWorkspaceAlignment, device);
  const auto address = reinterpret_cast<uintptr_t>(raw);
  return reinterpret_cast<void*>((address + kCublasWorkspaceAlignment - 1) /
                                 kCublasWorkspaceAlignment * kCublasWorkspaceAlignment);
}
CublasLtStates& cublaslt_states() {
  static CublasLtStates states;
  return states;
}

}  // namespace

// Created lazily per device and never destroyed: the handle and the workspace live as long as
// the process, like octet's streams (destroying them at exit would race with static tensors).
const CublasLt& cublaslt(const Device& device) {
  CublasLtStates& states = cublaslt_states();
  std::vector<CublasLt*>& devices = states.devices;
  OCTET_CHECK(device.is_cuda(), "cuBLASLt needs a CUDA device, got ", device);
  std::lock_guard lock(states.mutex);
  if (devices.empty()) devices.resize(std::max(cuda_device_count(), 1), nullptr);
  check_device_available(device);
  CublasLt*& slot = devices[device.index];
  if (slot == nullptr) {
    DeviceGuard guard(device);
    auto state = std::make_unique<CublasLt>();
    void* raw = nullptr;
    state->workspace = aligned_workspace(device, raw);
    state->workspace_bytes = kCublasWorkspaceBytes;
    const cublasStatus_t status = cublasLtCreate(&state->handle);
    if (status != CUBLAS_STATUS_SUCCESS) device_free(raw, device);
    OCTET_CHECK_CUBLAS(status);
    slot = state.release();
  }
  return *slot;
}

size_t cublaslt_device_bytes(const Device& device) {
  CublasLtStates& states = cublaslt_states();
  std::lock_guard lock(states.mutex);
  if (!device.is_cuda() || device.index < 0) return 0;
  const auto index = static_cast<size_t>(device.index);
  size_t workspaces = index < states.devices.size() && states.devices[index] != nullptr ? 1 : 0;
  if (index < states.lanes.size())
    for (const SideLane& lane : states.lanes[index]) workspaces += lane.workspace != nullptr;
  return workspaces * (kCublasWorkspaceBytes + kCublasWorkspaceAlignment);
}

// Side lanes live as long as the process, like the main state.
GemmLane gemm_lane(const Device& device, int lane) {
  OCTET_CHECK(lane >= 0 && lane < kGemmLanes, "gemm_lane: lane ", lane, " of ", kGemmLanes);
  const CublasLt& lt = cublaslt(device);  // also makes the devices' table
  if (lane == 0) return {lt.handle, octet::cuda::stream(device), lt.workspace, lt.workspace_bytes};
  CublasLtStates& states = cublaslt_states();
  std::lock_guard lock(states.mutex);
  if (states.lanes.size() < states.devices.size()) states.lanes.resize(states.devices.size());
  SideLane& side = states.lanes[device.index][lane];
  if (side.stream == nullptr) {
    DeviceGuard guard(device);
    void* raw = nullptr;
    void* workspace = aligned_workspace(device, raw);
    // The pool allocated on octet's stream: the side stream may use it once that is done.
    octet::cuda::synchronize(device);
    cudaStream_t stream = nullptr;
    const cudaError_t status = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (status != cudaSuccess) device_free(raw, device);
    OCTET_CHECK_CUDA(status);
    side = {stream, workspace};
  }
  return {lt.handle, side.stream, side.workspace, kCublasWorkspaceBytes};
}

// ----------------------------------------------------------------------------
// the planner

namespace {

/// Which split-K reductions cuBLASLt may use: always NONE (no split-K) or COMPUTE_TYPE (FP32
/// partials staged in the workspace, then reduced by a separate pass in a fixed order).
/// - OUTPUT_TYPE stages partials in D's type: for a BF16 D that rounds every partial sum, against
///   the one-rounding contract of docs/NUMERICS.md.
/// - INPLACE accumulates the K-slices into the output buffer itself (cublasLt.h: "using the output
///   buffer ... and counters (in workspace)"), so the order in which slices land follows the CTA
///   schedule: not deterministic, and in D's precision.
/// With these two excluded every algorithm is deterministic: the cuBLAS guide ("Results
/// reproducibility") promises bitwise-identical results run to run for one algorithm on one GPU
/// model when the workspace is the caller's, which it is here, and the algorithm per shape is
/// fixed by the cache below.
constexpr uint32_t kAllowedReductions =
    CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
/// The largest alignment cuBLASLt distinguishes (its MIN_ALIGNMENT preferences default to 256).
constexpr uint32_t kMaxAlignment = 256;

#define OCTET_SET_MATMUL_ATTR(desc, attr, value) \
  OCTET_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, attr, &(value), sizeof(value)))
#define OCTET_SET_PREFERENCE(pref, attr, value) \
  OCTET_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, attr, &(value), sizeof(value)))

struct PlanCache {
  std::mutex mutex;
  std::map<MatmulSpec::Key, Plan> plans;
  std::atomic<uint64_t> heuristic_queries{0};
  std::atomic<uint64_t> heuristic_nanoseconds{0};
  std::atomic<uint64_t> mxfp8_emulations{0};
  std::atomic<uint64_t> unfused_addends{0};
};
PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache;  // never destroyed: GEMMs may run during static exit
  return *cache;
}

/// Asks cuBLASLt for its best algorithm. Capability is detected this way only: a status of
/// NOT_SUPPORTED or zero results means "not on this GPU with this library", never a version
/// comparison. `probe` also reads INVALID_VALUE and ARCH_MISMATCH as a refusal, for the optional
/// features (a bias type, a block-scale mode) whose absence cuBLASLt may report that way.
bool query_heuristic(const MatmulSpec& spec, Descriptors& desc, bool restrict_reductions,
                     bool probe, cublasLtMatmulAlgo_t& algo) {
  const CublasLt& lt = cublaslt(*spec.device);
  cublasLtMatmulPreferenceOpaque_t pref;
  OCTET_CHECK_CUBLAS(cublasLtMatmulPreferenceInit(&pref));
  const uint64_t workspace_bytes = lt.workspace_bytes;
  OCTET_SET_PREFERENCE(&pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes);
  OCTET_SET_PREFERENCE(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, spec.align_a);
  OCTET_SET_PREFERENCE(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, spec.align_b);
  const uint32_t align_c = spec.addend ? spec.align_c : spec.align_d;
  OCTET_SET_PREFERENCE(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
  OCTET_SET_PREFERENCE(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, spec.align_d);
  if (restrict_reductions) {
    OCTET_SET_PREFERENCE(&pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, kAllowedReductions);
  }
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  const auto start = std::chrono::steady_clock::now();
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      lt.handle, &desc.op, &desc.a, &desc.b, &desc.c, &desc.d, &pref, 1, &result, &count);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  plan_cache().heuristic_queries.fetch_add(1, std::memory_order_relaxed);
  plan_cache().heuristic_nanoseconds.fetch_add(
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count()),
      std::memory_order_relaxed);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  if (probe && (status == CUBLAS_STATUS_INVALID_VALUE || status == CUBLAS_STATUS_ARCH_MISMATCH)) {
    return false;
  }
  OCTET_CHECK_CUBLAS(status);
  if (count == 0 || result.state != CUBLAS_STATUS_SUCCESS) return false;
  algo = result.algo;
  return true;
}

}  // namespace

cudaDataType_t cuda_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::e4m3:
      return CUDA_R_8F_E4M3;
    case DType::e5m2:
      return CUDA_R_8F_E5M2;
    default:
      OCTET_ERROR("gemm (CUDA): unsupported dtype ", dtype_name(dtype));
  }
}

/// -1 for dense operands (no scale attributes at all).
int32_t scale_mode(const GemmOperand& x) {
  if (!is_fp8(x.data.dtype())) return -1;
  switch (x.mode) {
    case fp8::ScalingMode::per_tensor:
      return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case fp8::ScalingMode::block_1x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case fp8::ScalingMode::block_128x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    case fp8::ScalingMode::mxfp8_1x32:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
  }
  OCTET_ERROR("gemm (CUDA): unknown scaling mode ", static_cast<int>(x.mode));
}

bool is_block_scaled(const GemmOperand& x) {
  return is_fp8(x.data.dtype()) && x.mode != fp8::ScalingMode::per_tensor;
}

uint32_t alignment_of(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  uint32_t alignment = kMaxAlignment;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

std::string gpu_name(const Device& device) {
  const cudaDeviceProp& props = octet::cuda::properties(device);
  return detail::concat(props.name, " (sm_", props.major, props.minor, ")");
}

LtOperand lt_operand(const GemmOperand& x) {
  LtOperand lt;
  lt.data = x.data.raw_data();
  lt.type = cuda_dtype(x.data.dtype());
  lt.op = x.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
  lt.rows = static_cast<uint64_t>(x.data.cols());
  lt.cols = static_cast<uint64_t>(x.data.rows());
  lt.ld = x.data.cols();
  lt.scale_mode = scale_mode(x);
  return lt;
}

void init_descriptors(const MatmulSpec& spec, const MatmulArgs& args, bool fused_bias,
                      Descriptors& desc) {
  OCTET_CHECK_CUBLAS(cublasLtMatmulDescInit(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  OCTET_SET_MATMUL_ATTR(&desc.op, CUBLASLT_MATMUL_DESC_TRANSA, spec.a.op);
  OCTET_SET_MATMUL_ATTR(&desc.op, CUBLASLT_MATMUL_DESC_TRANSB, spec.b.op);
  if (spec.a.scale_mode >= 0) {
    OCTET_SET_MATMUL_ATTR(&desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, spec.a.scale_mode);
    OCTET_SET_MATMUL_ATTR(&desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, spec.b.scale_mode);
    OCTET_SET_MATMUL_ATTR(&desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, args.a_scale);
    OCTET_SET_MATMUL_ATTR(&desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, args.b_scale);
  }
  if (spec.fast_accum >= 0) {
    OCTET_SET_MATMUL_ATTR(&desc.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, spec.fast_accum);
  }
  if (fused_bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    OCTET_SET_MATMUL_ATTR(&desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
    OCTET_SET_MATMUL_ATTR(&desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, args.bias);
    OCTET_SET_MATMUL_ATTR(&desc.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, spec.bias_type);
  }
  OCTET_CHECK_CUBLAS(
      cublasLtMatrixLayoutInit(&desc.a, spec.a.type, spec.a.rows, spec.a.cols, spec.a.ld));
  OCTET_CHECK_CUBLAS(
      cublasLtMatrixLayoutInit(&desc.b, spec.b.type, spec.b.rows, spec.b.cols, spec.b.ld));
  // C is D (beta accumulates into D in place) or the addend, which has D's dtype, shape and
  // leading dimension: the same layout either way, initialized twice so C never aliases D's.
  for (cublasLtMatrixLayoutOpaque_t* layout : {&desc.c, &desc.d}) {
    OCTET_CHECK_CUBLAS(cublasLtMatrixLayoutInit(layout, spec.d_type, static_cast<uint64_t>(spec.m),
                                                static_cast<uint64_t>(spec.n), spec.m));
  }
}

/// The first call per key asks the heuristic (with the bias epilogue when there is a bias, and
/// without it if cuBLASLt declines); later calls reuse the answer. With an addend only the fully
/// fused form (C = addend, and the bias epilogue when there is a bias) is asked for: anything less
/// needs a pass over D anyway, and add_epilogue then adds bias and addend with the contract's
/// rounding (unfused_addend).
Plan find_plan(const MatmulSpec& spec, const MatmulArgs& args) {
  PlanCache& cache = plan_cache();
  const MatmulSpec::Key key = spec.key();
  std::lock_guard lock(cache.mutex);  // held across the query: only the first call asks
  if (auto found = cache.plans.find(key); found != cache.plans.end()) return found->second;

  Plan plan;
  Descriptors desc;
  const bool with_bias = spec.bias_type >= 0;
  const bool block_scaled = spec.a.scale_mode > CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F ||
                            spec.b.scale_mode > CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  if (spec.addend) {
    init_descriptors(spec, args, with_bias, desc);
    const bool found =
        query_heuristic(spec, desc, /*restrict_reductions=*/true, /*probe=*/true, plan.algo);
    plan.outcome = found ? Outcome::ok : Outcome::unfused_addend;
    plan.fused_bias = found && with_bias;
    cache.plans.emplace(key, plan);
    return plan;
  }
  for (const bool fused_bias : {true, false}) {
    if (fused_bias && !with_bias) continue;
    init_descriptors(spec, args, fused_bias, desc);
    if (query_heuristic(spec, desc, /*restrict_reductions=*/true, fused_bias || block_scaled,
                        plan.algo)) {
      plan.outcome = Outcome::ok;
      plan.fused_bias = fused_bias;
      break;
    }
  }
  if (plan.outcome != Outcome::ok && spec.deterministic) {
    // Tell "nothing deterministic" apart from "nothing at all" for the error message.
    init_descriptors(spec, args, /*fused_bias=*/false, desc);
    cublasLtMatmulAlgo_t any;
    if (query_heuristic(spec, desc, false, block_scaled, any)) {
      plan.outcome = Outcome::no_deterministic_algorithm;
    }
  }
  cache.plans.emplace(key, plan);
  return plan;
}

void decline_addend(const MatmulSpec::Key& key) {
  PlanCache& cache = plan_cache();
  std::lock_guard lock(cache.mutex);
  cache.plans[key].outcome = Outcome::unfused_addend;
}

void count_mxfp8_emulation() {
  plan_cache().mxfp8_emulations.fetch_add(1, std::memory_order_relaxed);
}

void count_unfused_addend() {
  plan_cache().unfused_addends.fetch_add(1, std::memory_order_relaxed);
}

size_t gemm_cache_size() {
  PlanCache& cache = plan_cache();
  std::lock_guard lock(cache.mutex);
  return cache.plans.size();
}

uint64_t gemm_heuristic_queries() { return plan_cache().heuristic_queries.load(); }

double gemm_heuristic_seconds() {
  return static_cast<double>(plan_cache().heuristic_nanoseconds.load()) * 1e-9;
}

uint64_t gemm_mxfp8_emulations() { return plan_cache().mxfp8_emulations.load(); }

uint64_t gemm_unfused_addends() { return plan_cache().unfused_addends.load(); }

}  // namespace octet::ops::cuda
