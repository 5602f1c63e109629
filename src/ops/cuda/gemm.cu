// CUDA GEMM backend: cuBLASLt for dense (f32, bf16) and FP8 operands with per-tensor or block
// scales, plus the few small kernels cuBLASLt needs around it (scale layouts, a bias and addend
// epilogue where cuBLASLt's does not run, MXFP8 emulation on GPUs without native MXFP8).
//
// Row-major to column-major: cuBLASLt is column-major, and a row-major [r, c] matrix is the same
// memory as a column-major [c, r] one. So D = op(A) op(B) (row-major, [M, N]) is computed as
// D^T = op(B)^T op(A)^T (column-major, [N, M]): cuBLASLt's A is our B, its B is our A, its m is
// our n and its n is our m. The transposes carry over unchanged: our TN FP8 layout (A [M, K], B
// stored [N, K] and transposed) becomes cuBLASLt's A = [K, N] col-major with TRANSA = T and
// B = [K, M] col-major with TRANSB = N, the "TN" form Hopper's FP8 kernels require. Every
// per-operand attribute swaps with the operands: cuBLASLt's A_SCALE_* describe our B.
//
// cuBLASLt facts this file relies on (each one's source is in the comment where it is used):
// scale-tensor layouts of VEC128_32F, BLK128x128_32F and VEC32_UE8M0; which reduction schemes are
// deterministic; that block-scaled FP8 kernels do not take fast accumulation; which bias types
// are allowed (not relied on: the heuristic is asked, and a kernel of ours adds the bias when
// cuBLASLt declines); that C may be a matrix other than D (the addend, below).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>

#include "octet/core/cuda_context.h"
#include "octet/core/determinism.h"
#include "octet/fp8/format.h"
#include "ops/cuda/cublaslt.h"
#include "ops/gemm_backend.h"
#include "ops/quantize_backend.h"

namespace octet::ops::cuda {
namespace {

constexpr int kThreadsPerBlock = 256;

/// cuBLASLt's scale tensors for VEC128_32F keep the outer dimension contiguous and padded to a
/// multiple of 4 (16 bytes of f32), and BLK128x128_32F pads the K-block count to a multiple of 4:
/// TransformerEngine's "GEMM_READY" scale shapes, which it hands to cuBLASLt unchanged
/// (transformer_engine/pytorch/tensor/float8_blockwise_tensor.py get_scale_shape;
/// common/transpose/quantize_transpose_vector_blockwise.cu), and the sizes in NVIDIA's sample
/// CUDALibrarySamples/cuBLASLt/Common/helpers.h getScaleTensorSize.
constexpr int64_t kScalePadding = 4;
/// A caller's 128x128 scale tensor is used in place only when 16-byte aligned (the granularity of
/// that padding); anything less is copied. The algorithm is keyed on the alignment it gets.
constexpr uintptr_t kScaleAlignment = 16;
/// VEC32_UE8M0 scales are stored in 128-row x 4-block tiles of 512 bytes, tiles in row-major
/// order, swizzled inside the tile: offset = tile * 512 + (row % 32) * 16 + (row % 128 / 32) * 4 +
/// block % 4, rows padded to 128 and blocks to 4. Source: nvmath-python
/// nvmath/linalg/advanced/helpers/matmul.py get_mxfp8_scale_offset, and the tile sizes of
/// CUDALibrarySamples getScaleTensorSize (which points to the cuBLAS guide's "1D block scaling
/// factors layout"); TransformerEngine's swizzle pads the same way (nvte_swizzle_scaling_factors:
/// "padded to 128x4").
constexpr int64_t kMxTileRows = 128;
constexpr int64_t kMxTileBlocks = 4;
constexpr int64_t kMxTileBytes = kMxTileRows * kMxTileBlocks;
constexpr int64_t kMxRowGroup = 32;
constexpr int64_t kMxRowBytes = kMxTileBlocks * (kMxTileRows / kMxRowGroup);  // 16

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

unsigned int grid_for(int64_t n) {
  const int64_t blocks = ceil_div(n, kThreadsPerBlock);
  OCTET_CHECK(blocks <= INT32_MAX, "kernel over ", n, " elements exceeds the 1-D grid limit");
  return static_cast<unsigned int>(blocks);
}

__device__ __forceinline__ int64_t global_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ float load_float(const void* p, int64_t i, bool bf16) {
  return bf16 ? fp8::decode_bf16(static_cast<const uint16_t*>(p)[i])
              : static_cast<const float*>(p)[i];
}

// ----------------------------------------------------------------------------
// CUDA kernels

// octet's compact 1x128 scales f32[rows, blocks] (row-major) -> VEC128_32F: block-major with the
// rows contiguous, out[block * ld + row], ld = rows padded to kScalePadding.
__global__ void scales_1x128_to_vec128_kernel(const float* in, float* out, int64_t rows,
                                              int64_t blocks, int64_t ld) {
  const int64_t i = global_index();
  if (i >= blocks * ld) return;
  const int64_t block = i / ld;
  const int64_t row = i % ld;
  out[i] = row < rows ? in[row * blocks + block] : 0.0f;
}

// octet's compact 128x128 scales f32[tiles, blocks] -> BLK128x128_32F: same orientation, the
// block count padded to kScalePadding (out[tile * ld + block]).
__global__ void scales_128x128_to_blk128_kernel(const float* in, float* out, int64_t tiles,
                                                int64_t blocks, int64_t ld) {
  const int64_t i = global_index();
  if (i >= tiles * ld) return;
  const int64_t tile = i / ld;
  const int64_t block = i % ld;
  out[i] = block < blocks ? in[tile * blocks + block] : 0.0f;
}

// octet's compact MXFP8 scales e8m0[rows, blocks] -> VEC32_UE8M0's swizzled 128x4 tiles. One
// thread per output byte, so padding bytes are written too (as 2^-127: they scale no data).
__global__ void scales_mxfp8_to_vec32_kernel(const uint8_t* in, uint8_t* out, int64_t rows,
                                             int64_t blocks, int64_t padded_blocks, int64_t total) {
  const int64_t i = global_index();
  if (i >= total) return;
  const int64_t tile = i / kMxTileBytes;
  const int64_t within = i % kMxTileBytes;
  const int64_t tiles_per_row = padded_blocks / kMxTileBlocks;
  // Inverse of within = (row % 32) * 16 + (row % 128 / 32) * 4 + block % 4.
  const int64_t row = (tile / tiles_per_row) * kMxTileRows + within / kMxRowBytes +
                      (within % kMxRowBytes) / kMxTileBlocks * kMxRowGroup;
  const int64_t block = (tile % tiles_per_row) * kMxTileBlocks + within % kMxTileBlocks;
  out[i] = (row < rows && block < blocks) ? in[row * blocks + block] : 0;
}

// MXFP8 emulation: out = bf16(decode(q) * 2^scale). decode(q) has at most 4 significant bits and
// the product is a power-of-two scaling, so the bf16 rounding is exact unless the value leaves
// bf16's (= f32's) normal range.
__global__ void dequantize_mxfp8_to_bf16_kernel(const uint8_t* q, const uint8_t* scales,
                                                uint16_t* out, int64_t rows, int64_t cols,
                                                int64_t blocks, DType dtype) {
  const int64_t i = global_index();
  if (i >= rows * cols) return;
  const int64_t row = i / cols;
  const int64_t col = i % cols;
  const float value =
      fp8::decode_fp8(q[i], dtype) * fp8::decode_e8m0(scales[row * blocks + col / fp8::kMxBlock]);
  out[i] = fp8::encode_bf16(value);
}

// d = round_D(round_D(src) + bias[col] + addend) for row-major [rows, cols], in f32 in that
// order, where round_D rounds to d's dtype: the epilogue when cuBLASLt's does not run (it
// declined the bias or the addend, or an FP32 GEMM feeds a BF16 D). src is d itself (rounding it
// again changes nothing) or the FP32 product; bias and addend (d's dtype) are optional. With an
// addend this is the CPU contract's arithmetic exactly. A thread owns kEpilogueCols adjacent
// columns (loading their bias once) of kEpilogueRows rows, so there is no per-element division.
constexpr int kEpilogueCols = 2;
constexpr int kEpilogueRows = 8;
__global__ void add_epilogue_kernel(const void* src, bool src_bf16, void* d, bool d_bf16,
                                    const void* bias, bool bias_bf16, const void* addend,
                                    int64_t rows, int64_t cols) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kEpilogueCols;
  if (c0 >= cols) return;
  const int n = cols - c0 < kEpilogueCols ? static_cast<int>(cols - c0) : kEpilogueCols;
  float b[kEpilogueCols] = {};
  if (bias != nullptr) {
    for (int k = 0; k < n; ++k) b[k] = load_float(bias, c0 + k, bias_bf16);
  }
  // Grid-stride over groups of kEpilogueRows rows: gridDim.y is capped at CUDA's 65535.
  for (int64_t group = blockIdx.y; group * kEpilogueRows < rows; group += gridDim.y) {
    const int64_t r1 = min(rows, (group + 1) * kEpilogueRows);
    for (int64_t r = group * kEpilogueRows; r < r1; ++r) {
      for (int k = 0; k < n; ++k) {
        const int64_t i = r * cols + c0 + k;
        float value = load_float(src, i, src_bf16);
        if (d_bf16) value = fp8::decode_bf16(fp8::encode_bf16(value));
        if (bias != nullptr) value = value + b[k];
        if (addend != nullptr) value = value + load_float(addend, i, d_bf16);
        if (d_bf16) {
          static_cast<uint16_t*>(d)[i] = fp8::encode_bf16(value);
        } else {
          static_cast<float*>(d)[i] = value;
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------
// kernel launchers

/// VEC128_32F scales for `x` (data [rows, cols], 1x128 blocks along cols).
Tensor vec128_scales(const GemmOperand& x, cudaStream_t stream) {
  const int64_t rows = x.data.rows();
  const int64_t blocks = ceil_div(x.data.cols(), fp8::kBlock);
  const int64_t ld = round_up(rows, kScalePadding);
  Tensor out = Tensor::empty({blocks, ld}, DType::f32, x.data.device());
  scales_1x128_to_vec128_kernel<<<grid_for(blocks * ld), kThreadsPerBlock, 0, stream>>>(
      x.scale_inv.data<float>(), out.data<float>(), rows, blocks, ld);
  OCTET_CHECK_LAUNCH();
  return out;
}

/// BLK128x128_32F scales for `x` (data [rows, cols], 128x128 tiles).
Tensor blk128_scales(const GemmOperand& x, cudaStream_t stream) {
  const int64_t tiles = ceil_div(x.data.rows(), fp8::kBlock);
  const int64_t blocks = ceil_div(x.data.cols(), fp8::kBlock);
  const int64_t ld = round_up(blocks, kScalePadding);
  Tensor out = Tensor::empty({tiles, ld}, DType::f32, x.data.device());
  scales_128x128_to_blk128_kernel<<<grid_for(tiles * ld), kThreadsPerBlock, 0, stream>>>(
      x.scale_inv.data<float>(), out.data<float>(), tiles, blocks, ld);
  OCTET_CHECK_LAUNCH();
  return out;
}

/// VEC32_UE8M0 scales for `x` (data [rows, cols], 1x32 blocks along cols).
Tensor vec32_scales(const GemmOperand& x, cudaStream_t stream) {
  const int64_t rows = x.data.rows();
  const int64_t blocks = ceil_div(x.data.cols(), fp8::kMxBlock);
  const int64_t padded_blocks = round_up(blocks, kMxTileBlocks);
  const int64_t total = round_up(rows, kMxTileRows) * padded_blocks;
  Tensor out = Tensor::empty({total}, DType::e8m0, x.data.device());
  scales_mxfp8_to_vec32_kernel<<<grid_for(total), kThreadsPerBlock, 0, stream>>>(
      static_cast<const uint8_t*>(x.scale_inv.raw_data()), static_cast<uint8_t*>(out.raw_data()),
      rows, blocks, padded_blocks, total);
  OCTET_CHECK_LAUNCH();
  return out;
}

/// The BF16 matrix an MXFP8 operand stands for, same shape as x.data.
Tensor dequantize_mxfp8(const GemmOperand& x, cudaStream_t stream) {
  const int64_t rows = x.data.rows();
  const int64_t cols = x.data.cols();
  Tensor out = Tensor::empty(x.data.shape(), DType::bf16, x.data.device());
  dequantize_mxfp8_to_bf16_kernel<<<grid_for(rows * cols), kThreadsPerBlock, 0, stream>>>(
      static_cast<const uint8_t*>(x.data.raw_data()),
      static_cast<const uint8_t*>(x.scale_inv.raw_data()), static_cast<uint16_t*>(out.raw_data()),
      rows, cols, ceil_div(cols, fp8::kMxBlock), x.data.dtype());
  OCTET_CHECK_LAUNCH();
  return out;
}

/// d [rows, cols] = round_D(round_D(src) + bias + addend) (add_epilogue_kernel); src may be d,
/// bias and addend may be undefined.
void add_epilogue(const Tensor& src, const Tensor& d, const Tensor& bias, const Tensor& addend,
                  int64_t rows, int64_t cols, cudaStream_t stream) {
  constexpr int64_t kMaxGridY = 65535;
  const dim3 grid(static_cast<unsigned>(ceil_div(ceil_div(cols, kEpilogueCols), kThreadsPerBlock)),
                  static_cast<unsigned>(std::min(ceil_div(rows, kEpilogueRows), kMaxGridY)));
  add_epilogue_kernel<<<grid, kThreadsPerBlock, 0, stream>>>(
      src.raw_data(), src.dtype() == DType::bf16, d.raw_data(), d.dtype() == DType::bf16,
      bias.defined() ? bias.raw_data() : nullptr, bias.defined() && bias.dtype() == DType::bf16,
      addend.defined() ? addend.raw_data() : nullptr, rows, cols);
  OCTET_CHECK_LAUNCH();
}

// ----------------------------------------------------------------------------
// cuBLASLt plumbing

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
/// FP8 tensor cores arrived with compute capability 8.9 (Ada); Hopper is 9.0.
constexpr int kFirstFp8ComputeCapability = 89;

#define OCTET_SET_MATMUL_ATTR(desc, attr, value) \
  OCTET_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, attr, &(value), sizeof(value)))
#define OCTET_SET_PREFERENCE(pref, attr, value) \
  OCTET_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, attr, &(value), sizeof(value)))

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

/// One cuBLASLt input in cuBLASLt's column-major terms: our row-major [r, c] is its [c, r].
struct LtOperand {
  const void* data = nullptr;
  cudaDataType_t type = CUDA_R_32F;
  cublasOperation_t op = CUBLAS_OP_N;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
  int32_t scale_mode = -1;  ///< -1: dense, no scale attributes
};

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

struct PlanCache {
  std::mutex mutex;
  std::map<MatmulSpec::Key, Plan> plans;
  std::atomic<uint64_t> heuristic_queries{0};
  std::atomic<uint64_t> mxfp8_emulations{0};
  std::atomic<uint64_t> unfused_addends{0};
};
PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache;  // never destroyed: GEMMs may run during static exit
  return *cache;
}

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
  plan_cache().heuristic_queries.fetch_add(1, std::memory_order_relaxed);
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      lt.handle, &desc.op, &desc.a, &desc.b, &desc.c, &desc.d, &pref, 1, &result, &count);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  if (probe && (status == CUBLAS_STATUS_INVALID_VALUE || status == CUBLAS_STATUS_ARCH_MISMATCH)) {
    return false;
  }
  OCTET_CHECK_CUBLAS(status);
  if (count == 0 || result.state != CUBLAS_STATUS_SUCCESS) return false;
  algo = result.algo;
  return true;
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

std::string describe(const GemmOperand& x) {
  return detail::concat(x.data.describe(), is_fp8(x.data.dtype()) ? " " : "",
                        is_fp8(x.data.dtype()) ? fp8::scaling_mode_name(x.mode) : "",
                        x.transpose ? " (transposed)" : "");
}

std::string describe(const GemmOperand& a, const GemmOperand& b, const Tensor& d,
                     const GemmShape& shape) {
  return detail::concat("A ", describe(a), " x B ", describe(b), " -> D ", d.describe(),
                        " (m=", shape.m, ", n=", shape.n, ", k=", shape.k, ")");
}

/// The scale pointer cuBLASLt reads for `x`, converting octet's compact layout where cuBLASLt's
/// differs. A converted copy comes from the stream-ordered pool into `storage`, which the caller
/// keeps until the matmul is enqueued; freeing it then is ordered after the matmul on the stream.
const void* lt_scale(const GemmOperand& x, Tensor& storage, cudaStream_t stream) {
  if (!is_fp8(x.data.dtype())) return nullptr;
  const Shape expected = fp8::scale_shape(x.mode, x.data.rows(), x.data.cols());
  OCTET_CHECK(x.scale_inv.defined() && x.scale_inv.dtype() == fp8::scale_dtype(x.mode) &&
                  x.scale_inv.numel() == shape_numel(expected),
              "gemm (CUDA): ", fp8::scaling_mode_name(x.mode), " scale_inv for ", x.data.describe(),
              " must be ", dtype_name(fp8::scale_dtype(x.mode)), shape_str(expected), ", got ",
              x.scale_inv.defined() ? x.scale_inv.describe() : std::string("none"));
  switch (x.mode) {
    case fp8::ScalingMode::per_tensor:
      return x.scale_inv.raw_data();  // the device scalar itself: no copy on the hot path
    case fp8::ScalingMode::block_1x128:
      storage = vec128_scales(x, stream);
      return storage.raw_data();
    case fp8::ScalingMode::block_128x128: {
      const bool padded = ceil_div(x.data.cols(), fp8::kBlock) % kScalePadding == 0;
      const bool aligned =
          reinterpret_cast<uintptr_t>(x.scale_inv.raw_data()) % kScaleAlignment == 0;
      if (padded && aligned) return x.scale_inv.raw_data();  // already cuBLASLt's layout
      storage = blk128_scales(x, stream);
      return storage.raw_data();
    }
    case fp8::ScalingMode::mxfp8_1x32:
      storage = vec32_scales(x, stream);
      return storage.raw_data();
  }
  OCTET_ERROR("gemm (CUDA): unknown scaling mode ", static_cast<int>(x.mode));
}

MatmulSpec make_spec(const Device& device, const GemmOperand& a, const GemmOperand& b,
                     const Tensor& d, const GemmArgs& args, const GemmShape& shape) {
  MatmulSpec spec;
  spec.device = &device;
  spec.a = lt_operand(b);
  spec.b = lt_operand(a);
  spec.d_type = cuda_dtype(d.dtype());
  spec.m = shape.n;
  spec.n = shape.m;
  spec.k = shape.k;
  // FAST_ACCUM only means something for per-tensor FP8 on Hopper, where the tensor cores keep a
  // narrower running sum unless cuBLASLt promotes it. Block-scaled kernels rescale and promote
  // at every 128-wide K block, i.e. they accumulate split by construction, and cuBLASLt does not
  // offer them with fast accumulation (PyTorch's scaled_gemm rejects fast_accum with 1x128 and
  // 128x128 blockwise scaling for this reason), so for them the attribute is left at 0.
  if (is_fp8(a.data.dtype())) {
    const bool fast =
        args.accumulation == Accumulation::fast && !is_block_scaled(a) && !is_block_scaled(b);
    spec.fast_accum = fast ? 1 : 0;
  }
  if (args.bias.defined()) {
    spec.bias_type = cuda_dtype(args.bias.dtype());
    spec.align_bias = alignment_of(args.bias.raw_data());
  }
  spec.beta_nonzero = args.beta != 0.0f;
  if (args.addend.defined()) {
    spec.addend = true;
    spec.align_c = alignment_of(args.addend.raw_data());
  }
  spec.deterministic = deterministic();
  spec.align_a = alignment_of(spec.a.data);
  spec.align_b = alignment_of(spec.b.data);
  spec.align_d = alignment_of(d.raw_data());
  return spec;
}

void throw_no_plan(Outcome outcome, const GemmOperand& a, const GemmOperand& b, const Tensor& d,
                   const GemmShape& shape) {
  const std::string gpu = gpu_name(d.device());
  if (outcome == Outcome::no_deterministic_algorithm) {
    OCTET_ERROR("gemm: determinism was requested, but cuBLASLt on ", gpu,
                " offers only algorithms with a non-deterministic (in-place split-K) reduction "
                "for ",
                describe(a, b, d, shape),
                "; remedy: turn determinism off (unset OCTET_DETERMINISTIC and call "
                "octet::set_deterministic(false)) for this GEMM, or change its shape");
  }
  if (is_block_scaled(a) || is_block_scaled(b)) {
    OCTET_ERROR("gemm: cuBLASLt on ", gpu, " does not support FP8 GEMMs with ",
                fp8::scaling_mode_name(a.mode), " x ", fp8::scaling_mode_name(b.mode),
                " block scales (scale modes VEC128_32F / BLK128x128_32F) for ",
                describe(a, b, d, shape),
                "; block-scaled FP8 GEMMs need a GPU and cuBLASLt that offer them (Hopper)");
  }
  OCTET_ERROR("gemm: cuBLASLt on ", gpu, " has no algorithm for ", describe(a, b, d, shape));
}

/// `args` for the product alone, alpha * op(A) op(B): what add_epilogue completes.
GemmArgs product_only(const GemmArgs& args) {
  GemmArgs product = args;
  product.bias = Tensor();
  product.addend = Tensor();
  return product;
}

/// Remembers that cublasLtMatmul refused the fused addend for `key` (the heuristic offered it).
void decline_addend(const MatmulSpec::Key& key) {
  PlanCache& cache = plan_cache();
  std::lock_guard lock(cache.mutex);
  cache.plans[key].outcome = Outcome::unfused_addend;
}

bool run_cublaslt(const Device& device, const GemmOperand& a, const GemmOperand& b, const Tensor& d,
                  const GemmArgs& args, const GemmShape& shape);

/// The addend where cuBLASLt's epilogue does not take it: D = alpha * op(A) op(B) rounded to D's
/// dtype, then add_epilogue adds bias and addend (the contract's arithmetic). The first time it
/// happens is said on stderr and every time is counted (gemm_unfused_addends), so a slow path is
/// never silent. Returns run_cublaslt's answer for the product.
bool run_unfused_addend(const Device& device, const GemmOperand& a, const GemmOperand& b,
                        const Tensor& d, const GemmArgs& args, const GemmShape& shape) {
  if (!run_cublaslt(device, a, b, d, product_only(args), shape)) return false;
  add_epilogue(d, d, args.bias, args.addend, shape.m, shape.n, octet::cuda::stream(device));
  static std::once_flag note;
  std::call_once(note, [&] {
    std::fprintf(stderr,
                 "octet: cuBLASLt on %s declined a GEMM's addend (C != D) for %s; the addend is "
                 "added by a separate pass\n",
                 gpu_name(device).c_str(), describe(a, b, d, shape).c_str());
  });
  plan_cache().unfused_addends.fetch_add(1, std::memory_order_relaxed);
  return true;
}

/// Runs one GEMM through cuBLASLt. Returns false (having enqueued no matmul) only for MXFP8
/// operands that cuBLASLt cannot multiply natively; every other refusal throws.
bool run_cublaslt(const Device& device, const GemmOperand& a, const GemmOperand& b, const Tensor& d,
                  const GemmArgs& args, const GemmShape& shape) {
  MatmulSpec spec = make_spec(device, a, b, d, args, shape);
  cudaStream_t stream = octet::cuda::stream(device);
  const bool mxfp8 = is_fp8(a.data.dtype()) && a.mode == fp8::ScalingMode::mxfp8_1x32;
  // Where cuBLASLt has no native MXFP8 this converts scales that the emulation then ignores: a
  // pass over M*K/32 bytes, next to the dequantization's 3*M*K.
  Tensor a_scale_storage, b_scale_storage;
  MatmulArgs call;
  call.a_scale = lt_scale(b, a_scale_storage, stream);  // cuBLASLt's A is our B
  call.b_scale = lt_scale(a, b_scale_storage, stream);
  if (call.a_scale != nullptr) spec.align_a_scale = alignment_of(call.a_scale);
  if (call.b_scale != nullptr) spec.align_b_scale = alignment_of(call.b_scale);
  call.bias = args.bias.defined() ? args.bias.raw_data() : nullptr;
  call.d = d.raw_data();
  // The addend is C with beta = 1 (validation made args.beta 0); otherwise C is D itself.
  call.c = spec.addend ? args.addend.raw_data() : call.d;
  call.alpha = args.alpha;
  call.beta = spec.addend ? 1.0f : args.beta;

  const Plan plan = find_plan(spec, call);
  if (plan.outcome == Outcome::unfused_addend) {
    return run_unfused_addend(device, a, b, d, args, shape);
  }
  if (plan.outcome == Outcome::unsupported && mxfp8) return false;
  if (plan.outcome != Outcome::ok) throw_no_plan(plan.outcome, a, b, d, shape);

  Descriptors desc;
  init_descriptors(spec, call, plan.fused_bias, desc);
  const CublasLt& lt = cublaslt(device);
  const cublasStatus_t status = cublasLtMatmul(
      lt.handle, &desc.op, &call.alpha, spec.a.data, &desc.a, spec.b.data, &desc.b, &call.beta,
      call.c, &desc.c, call.d, &desc.d, &plan.algo, lt.workspace, lt.workspace_bytes, stream);
  // The heuristic sees C's layout but not its address, so C != D may still be refused here;
  // such a refusal enqueues nothing, and the key falls back from now on.
  if (spec.addend &&
      (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE)) {
    decline_addend(spec.key());
    return run_unfused_addend(device, a, b, d, args, shape);
  }
  OCTET_CHECK_CUBLAS(status);
  if (args.bias.defined() && !plan.fused_bias) {
    add_epilogue(d, d, args.bias, Tensor(), shape.m, shape.n, stream);
  }
  return true;
}

/// MXFP8 where cuBLASLt has no native kernel (before sm_100): dequantize both operands to BF16
/// (exact, see dequantize_mxfp8_to_bf16_kernel), then the BF16 GEMM.
void run_mxfp8_emulated(const Device& device, const GemmOperand& a, const GemmOperand& b,
                        const Tensor& d, const GemmArgs& args, const GemmShape& shape) {
  static std::once_flag note;
  std::call_once(note, [&] {
    std::fprintf(stderr, "octet: MXFP8 GEMM emulated on %s: dequantize to BF16 + BF16 GEMM\n",
                 gpu_name(device).c_str());
  });
  cudaStream_t stream = octet::cuda::stream(device);
  const GemmOperand a16{dequantize_mxfp8(a, stream), Tensor(), fp8::ScalingMode::per_tensor,
                        a.transpose};
  const GemmOperand b16{dequantize_mxfp8(b, stream), Tensor(), fp8::ScalingMode::per_tensor,
                        b.transpose};
  run_cublaslt(device, a16, b16, d, args, shape);
  plan_cache().mxfp8_emulations.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

size_t gemm_cache_size() {
  PlanCache& cache = plan_cache();
  std::lock_guard lock(cache.mutex);
  return cache.plans.size();
}

uint64_t gemm_heuristic_queries() { return plan_cache().heuristic_queries.load(); }

uint64_t gemm_mxfp8_emulations() { return plan_cache().mxfp8_emulations.load(); }

uint64_t gemm_unfused_addends() { return plan_cache().unfused_addends.load(); }

void gemm(const GemmOperand& a, const GemmOperand& b, const Tensor& d, const GemmArgs& args,
          const GemmShape& shape) {
  const Device device = common_device(
      {&a.data, &b.data, &d, a.scale_inv.defined() ? &a.scale_inv : nullptr,
       b.scale_inv.defined() ? &b.scale_inv : nullptr, args.bias.defined() ? &args.bias : nullptr,
       args.addend.defined() ? &args.addend : nullptr},
      "gemm");
  OCTET_CHECK(device.is_cuda(), "gemm (CUDA): tensors must be on a GPU, got ", device);
  DeviceGuard guard(device);
  if (is_fp8(a.data.dtype()) || is_fp8(b.data.dtype())) {
    const cudaDeviceProp& props = octet::cuda::properties(device);
    OCTET_CHECK(props.major * 10 + props.minor >= kFirstFp8ComputeCapability,
                "gemm: FP8 GEMMs need FP8 tensor cores (compute capability 8.9 or newer); ", device,
                " is ", gpu_name(device));
  }
  if (a.data.dtype() == DType::f32 && d.dtype() == DType::bf16) {
    // cuBLASLt's FP32 GEMM writes FP32 only: go through an FP32 D and round to BF16 once at the
    // end, as the CPU reference does. With an addend the contract rounds the product first, so
    // the FP32 GEMM computes the product alone and add_epilogue does the rest.
    const Tensor d_bf16 = d.view({shape.m, shape.n});
    Tensor d_f32 = Tensor::empty({shape.m, shape.n}, DType::f32, device);
    if (args.addend.defined()) {
      run_cublaslt(device, a, b, d_f32, product_only(args), shape);
      add_epilogue(d_f32, d_bf16, args.bias, args.addend, shape.m, shape.n,
                   octet::cuda::stream(device));
      return;
    }
    if (args.beta != 0.0f) cast(d_bf16, d_f32);
    run_cublaslt(device, a, b, d_f32, args, shape);
    cast(d_f32, d_bf16);
    return;
  }
  if (run_cublaslt(device, a, b, d, args, shape)) return;
  run_mxfp8_emulated(device, a, b, d, args, shape);
}

}  // namespace octet::ops::cuda
