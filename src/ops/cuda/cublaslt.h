// Private to the CUDA GEMM families (gemm, grouped_gemm): the cuBLASLt status check, one handle
// and one workspace per device, and the planner both GEMMs use: the matmul key, the algorithm
// heuristic with its determinism filter, the plan cache, and cuBLASLt's scale layouts.
#pragma once

#include <cublasLt.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "octet/core/device.h"
#include "octet/core/error.h"
#include "octet/core/tensor.h"
#include "octet/ops/gemm.h"

/// Throws octet::Error naming the cuBLAS status and the failed call.
#define OCTET_CHECK_CUBLAS(call)                                                      \
  do {                                                                                \
    cublasStatus_t octet_cublas_status_ = (call);                                     \
    if (octet_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                              \
      OCTET_ERROR("cuBLAS error ", cublasLtGetStatusName(octet_cublas_status_), " (", \
                  cublasLtGetStatusString(octet_cublas_status_), ") in ", #call);     \
    }                                                                                 \
  } while (false)

namespace octet::ops::cuda {

/// cuBLASLt workspace per device. 32 MiB is what the cuBLAS guide recommends for Hopper
/// (cublasSetWorkspace: "32 MiB for Hopper, 4 MiB otherwise"); PyTorch uses the same figure.
inline constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
/// cuBLASLt wants the workspace 256-byte aligned (TransformerEngine checks the same).
inline constexpr size_t kCublasWorkspaceAlignment = 256;

/// What every cuBLASLt call on a device needs.
struct CublasLt {
  cublasLtHandle_t handle = nullptr;  ///< created once under a DeviceGuard for the device
  void* workspace = nullptr;          ///< kCublasWorkspaceBytes, allocated once via device_alloc
  size_t workspace_bytes = 0;
};
/// The device's cuBLASLt handle and workspace, created on first use and kept for the process.
/// Every GEMM on octet's stream for the device uses this workspace (they run one at a time).
const CublasLt& cublaslt(const Device& device);
/// Device bytes the device's cuBLASLt state holds (its workspaces with the alignment slack); 0
/// before its first GEMM.
size_t cublaslt_device_bytes(const Device& device);

/// Where one cuBLASLt call runs: a stream, and a workspace no call in flight elsewhere uses; with
/// the device's handle, so a call needs no second lookup.
struct GemmLane {
  cublasLtHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
/// Lanes a grouped GEMM spreads its groups over. Four 1024-row expert GEMMs in flight fill the
/// GPU's SMs where one leaves most idle; each extra lane costs a 32 MiB workspace.
inline constexpr int kGemmLanes = 4;
/// Lane 0 is octet's stream for the device with the device's workspace; lanes 1 .. kGemmLanes - 1
/// have a stream and a workspace of their own, made the first time they are asked for.
GemmLane gemm_lane(const Device& device, int lane);


/// Entries in the GEMM algorithm cache (one per device, shape, dtypes, layouts, ... key).
size_t gemm_cache_size();
/// How many times the GEMM backend asked cuBLASLt for a heuristic since the process started, and
/// the host seconds those queries took.
uint64_t gemm_heuristic_queries();
double gemm_heuristic_seconds();
/// How many MXFP8 GEMMs ran emulated (dequantize to BF16, then a BF16 GEMM).
uint64_t gemm_mxfp8_emulations();
/// How many GEMMs with an addend ran it as a separate pass because cuBLASLt declined C != D (its
/// heuristic found no such algorithm, or cublasLtMatmul refused one). FP32 operands with a BF16 D
/// always add it separately (cuBLASLt's FP32 GEMM writes FP32) and are not counted.
uint64_t gemm_unfused_addends();

/// cuBLASLt's data type for an octet dtype (f32, bf16, e4m3, e5m2); throws for any other.
cudaDataType_t cuda_dtype(DType dtype);
/// cuBLASLt's scale mode (CUBLASLT_MATMUL_MATRIX_SCALE_*) for an FP8 operand; -1 for dense ones.
int32_t scale_mode(const GemmOperand& x);
/// FP8 with block or MXFP8 scales (anything but one scale per tensor).
bool is_block_scaled(const GemmOperand& x);
/// The largest power of two up to 256 that divides the address.
uint32_t alignment_of(const void* ptr);
/// "NVIDIA H200 (sm_90)": how error messages name a GPU.
std::string gpu_name(const Device& device);

/// One cuBLASLt input in cuBLASLt's column-major terms: our row-major [r, c] is its [c, r].
struct LtOperand {
  const void* data = nullptr;
  cudaDataType_t type = CUDA_R_32F;
  cublasOperation_t op = CUBLAS_OP_N;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
  int32_t scale_mode = -1;  ///< -1: dense, no scale attributes
};
LtOperand lt_operand(const GemmOperand& x);

/// Everything that decides the algorithm. Pointers enter only through their alignment, which is
/// what cuBLASLt's choice depends on (its MIN_ALIGNMENT preferences, and the bias and scale
/// pointers it inspects without dereferencing them).
struct MatmulSpec {
  const Device* device = nullptr;
  LtOperand a, b;  ///< cuBLASLt's A (= our B) and B (= our A)
  cudaDataType_t d_type = CUDA_R_32F;
  int64_t m = 0, n = 0, k = 0;  ///< cuBLASLt's: m = our n, n = our m
  int8_t fast_accum = -1;       ///< -1: attribute not set (dense and block-scaled operands)
  int32_t bias_type = -1;       ///< -1: no bias
  bool beta_nonzero = false;
  bool addend = false;  ///< C is the addend, a matrix other than D (read with beta = 1)
  bool deterministic = false;
  uint32_t align_a = 0, align_b = 0, align_d = 0, align_bias = 0;
  uint32_t align_c = 0;                           ///< the addend's; 0 without one
  uint32_t align_a_scale = 0, align_b_scale = 0;  ///< 0: no scale tensor

  using Key = std::array<int64_t, 23>;
  Key key() const {
    return {device->index,
            m,
            n,
            k,
            a.type,
            b.type,
            d_type,
            a.op,
            b.op,
            a.scale_mode,
            b.scale_mode,
            fast_accum,
            bias_type,
            beta_nonzero,
            addend,
            deterministic,
            align_a,
            align_b,
            align_d,
            align_bias,
            align_c,
            align_a_scale,
            align_b_scale};
  }
};

/// What the cache remembers per key: the algorithm, or why there is none. unfused_addend: cuBLASLt
/// declined C != D for this key (its heuristic found nothing, or cublasLtMatmul refused it), so
/// the GEMM runs without bias and addend and add_epilogue adds both.
enum class Outcome : uint8_t { ok, unsupported, no_deterministic_algorithm, unfused_addend };
struct Plan {
  Outcome outcome = Outcome::unsupported;
  bool fused_bias = false;  ///< false with a bias: cuBLASLt declined it, add_epilogue runs after
  cublasLtMatmulAlgo_t algo{};
};

/// The pointers and scalars of one call; the spec says how to read them.
struct MatmulArgs {
  const void* a_scale = nullptr;
  const void* b_scale = nullptr;
  const void* bias = nullptr;
  const void* c = nullptr;  ///< the addend, or D itself (beta accumulates in place)
  void* d = nullptr;
  float alpha = 1.0f, beta = 0.0f;
};

/// Descriptors live on the stack (the *Init calls fill caller-owned storage), so a call costs
/// no allocation and threads never share a descriptor.
struct Descriptors {
  cublasLtMatmulDescOpaque_t op;
  cublasLtMatrixLayoutOpaque_t a, b, c, d;
};

/// Which algorithm runs a spec: the first call per key asks the heuristic, later calls reuse the
/// answer (see cublaslt.cc).
Plan find_plan(const MatmulSpec& spec, const MatmulArgs& args);
/// Remembers that cublasLtMatmul refused the fused addend for `key` (the heuristic offered it).
void decline_addend(const MatmulSpec::Key& key);
/// Counted for gemm_mxfp8_emulations() and gemm_unfused_addends().
void count_mxfp8_emulation();
void count_unfused_addend();

/// Fills `desc` for one call of `spec` with `args`' scale and bias pointers.
void init_descriptors(const MatmulSpec& spec, const MatmulArgs& args, bool fused_bias,
                      Descriptors& desc);

/// The scale pointer cuBLASLt reads for `x`, converting octet's compact layout where cuBLASLt's
/// differs. A converted copy comes from the stream-ordered pool into `storage`, which the caller
/// keeps until the matmul is enqueued; freeing it then is ordered after the matmul on `stream`.
/// nullptr for dense operands. (cublaslt_scales.cu: the layout kernels.)
const void* lt_scale(const GemmOperand& x, Tensor& storage, cudaStream_t stream);

}  // namespace octet::ops::cuda
