// CUDA GEMM backend: cuBLASLt for dense (f32, bf16) and FP8 operands with per-tensor or block
// scales, through the planner in cublaslt.h (key, heuristic, determinism filter, plan cache,
// scale layouts), plus the small kernels cuBLASLt needs around it (a bias and addend epilogue
// where cuBLASLt's does not run, MXFP8 emulation on GPUs without native MXFP8).
//
// Row-major to column-major: cuBLASLt is column-major, and a row-major [r, c] matrix is the same
// memory as a column-major [c, r] one. So D = op(A) op(B) (row-major, [M, N]) is computed as
// D^T = op(B)^T op(A)^T (column-major, [N, M]): cuBLASLt's A is our B, its B is our A, its m is
// our n and its n is our m. The transposes carry over unchanged: our TN FP8 layout (A [M, K], B
// stored [N, K] and transposed) becomes cuBLASLt's A = [K, N] col-major with TRANSA = T and
// B = [K, M] col-major with TRANSB = N, the "TN" form Hopper's FP8 kernels require. Every
// per-operand attribute swaps with the operands: cuBLASLt's A_SCALE_* describe our B.
//
// cuBLASLt facts this file relies on (each one's source is in the comment where it is used; the
// scale layouts and the deterministic reduction schemes are the planner's, in cublaslt.cc and
// cublaslt_scales.cu): that block-scaled FP8 kernels do not take fast accumulation; which bias types
// are allowed (not relied on: the heuristic is asked, and a kernel of ours adds the bias when
// cuBLASLt declines); that C may be a matrix other than D (the addend, below).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

#include "octet/core/cuda_context.h"
#include "octet/core/determinism.h"
#include "octet/fp8/format.h"
#include "ops/cuda/cublaslt.h"
#include "ops/cuda/launch_util.cuh"
#include "ops/gemm_backend.h"
#include "ops/quantize_backend.h"

namespace octet::ops::cuda {
namespace {

__device__ __forceinline__ float load_float(const void* p, int64_t i, bool bf16) {
  return bf16 ? fp8::decode_bf16(static_cast<const uint16_t*>(p)[i])
              : static_cast<const float*>(p)[i];
}

// ----------------------------------------------------------------------------
// CUDA kernels

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
  const dim3 grid(static_cast<unsigned>(ceil_div(ceil_div(cols, kEpilogueCols), kThreadsPerBlock)),
                  static_cast<unsigned>(std::min(ceil_div(rows, kEpilogueRows), kMaxGridY)));
  add_epilogue_kernel<<<grid, kThreadsPerBlock, 0, stream>>>(
      src.raw_data(), src.dtype() == DType::bf16, d.raw_data(), d.dtype() == DType::bf16,
      bias.defined() ? bias.raw_data() : nullptr, bias.defined() && bias.dtype() == DType::bf16,
      addend.defined() ? addend.raw_data() : nullptr, rows, cols);
  OCTET_CHECK_LAUNCH();
}

/// FP8 tensor cores arrived with compute capability 8.9 (Ada); Hopper is 9.0.
constexpr int kFirstFp8ComputeCapability = 89;

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

bool run_cublaslt(const Device& device, const GemmLane& lane, const GemmOperand& a,
                  const GemmOperand& b, const Tensor& d, const GemmArgs& args,
                  const GemmShape& shape);

/// The addend where cuBLASLt's epilogue does not take it: D = alpha * op(A) op(B) rounded to D's
/// dtype, then add_epilogue adds bias and addend (the contract's arithmetic). The first time it
/// happens is said on stderr and every time is counted (gemm_unfused_addends), so a slow path is
/// never silent. Returns run_cublaslt's answer for the product.
bool run_unfused_addend(const Device& device, const GemmLane& lane, const GemmOperand& a,
                        const GemmOperand& b, const Tensor& d, const GemmArgs& args,
                        const GemmShape& shape) {
  if (!run_cublaslt(device, lane, a, b, d, product_only(args), shape)) return false;
  add_epilogue(d, d, args.bias, args.addend, shape.m, shape.n, lane.stream);
  static std::once_flag note;
  std::call_once(note, [&] {
    std::fprintf(stderr,
                 "octet: cuBLASLt on %s declined a GEMM's addend (C != D) for %s; the addend is "
                 "added by a separate pass\n",
                 gpu_name(device).c_str(), describe(a, b, d, shape).c_str());
  });
  count_unfused_addend();
  return true;
}

/// Runs one GEMM through cuBLASLt on `lane`. Returns false (having enqueued no matmul) only for
/// MXFP8 operands that cuBLASLt cannot multiply natively; every other refusal throws.
bool run_cublaslt(const Device& device, const GemmLane& lane, const GemmOperand& a,
                  const GemmOperand& b, const Tensor& d, const GemmArgs& args,
                  const GemmShape& shape) {
  MatmulSpec spec = make_spec(device, a, b, d, args, shape);
  cudaStream_t stream = lane.stream;
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
    return run_unfused_addend(device, lane, a, b, d, args, shape);
  }
  if (plan.outcome == Outcome::unsupported && mxfp8) return false;
  if (plan.outcome != Outcome::ok) throw_no_plan(plan.outcome, a, b, d, shape);

  Descriptors desc;
  init_descriptors(spec, call, plan.fused_bias, desc);
  const cublasStatus_t status = cublasLtMatmul(
      lane.handle, &desc.op, &call.alpha, spec.a.data, &desc.a, spec.b.data, &desc.b, &call.beta,
      call.c, &desc.c, call.d, &desc.d, &plan.algo, lane.workspace, lane.workspace_bytes, stream);
  // The heuristic sees C's layout but not its address, so C != D may still be refused here;
  // such a refusal enqueues nothing, and the key falls back from now on.
  if (spec.addend &&
      (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE)) {
    decline_addend(spec.key());
    return run_unfused_addend(device, lane, a, b, d, args, shape);
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
  run_cublaslt(device, gemm_lane(device, 0), a16, b16, d, args, shape);
  count_mxfp8_emulation();
}

/// The GPU every tensor of the GEMM is on, checked to have what the operands need.
Device gemm_device(const GemmOperand& a, const GemmOperand& b, const Tensor& d,
                   const GemmArgs& args) {
  const Device device = common_device(
      {&a.data, &b.data, &d, a.scale_inv.defined() ? &a.scale_inv : nullptr,
       b.scale_inv.defined() ? &b.scale_inv : nullptr, args.bias.defined() ? &args.bias : nullptr,
       args.addend.defined() ? &args.addend : nullptr},
      "gemm");
  OCTET_CHECK(device.is_cuda(), "gemm (CUDA): tensors must be on a GPU, got ", device);
  if (is_fp8(a.data.dtype()) || is_fp8(b.data.dtype())) {
    const cudaDeviceProp& props = octet::cuda::properties(device);
    OCTET_CHECK(props.major * 10 + props.minor >= kFirstFp8ComputeCapability,
                "gemm: FP8 GEMMs need FP8 tensor cores (compute capability 8.9 or newer); ", device,
                " is ", gpu_name(device));
  }
  return device;
}

}  // namespace

bool runs_on_any_lane(const GemmOperand& a, const GemmOperand& b, const Tensor& d) {
  return !is_block_scaled(a) && !is_block_scaled(b) &&
         !(a.data.dtype() == DType::f32 && d.dtype() == DType::bf16);
}

void gemm_on_lane(int lane, const GemmOperand& a, const GemmOperand& b, const Tensor& d,
                  const GemmArgs& args, const GemmShape& shape) {
  OCTET_CHECK(runs_on_any_lane(a, b, d), "gemm_on_lane: ", describe(a, b, d, shape),
              " takes temporaries that only lane 0 may use");
  const Device device = gemm_device(a, b, d, args);
  DeviceGuard guard(device);
  const bool ran = run_cublaslt(device, gemm_lane(device, lane), a, b, d, args, shape);
  OCTET_CHECK(ran, "gemm_on_lane: cuBLASLt took no algorithm for ", describe(a, b, d, shape));
}

void gemm(const GemmOperand& a, const GemmOperand& b, const Tensor& d, const GemmArgs& args,
          const GemmShape& shape) {
  const Device device = gemm_device(a, b, d, args);
  DeviceGuard guard(device);
  const GemmLane lane = gemm_lane(device, 0);
  if (a.data.dtype() == DType::f32 && d.dtype() == DType::bf16) {
    // cuBLASLt's FP32 GEMM writes FP32 only: go through an FP32 D and round to BF16 once at the
    // end, as the CPU reference does. With an addend the contract rounds the product first, so
    // the FP32 GEMM computes the product alone and add_epilogue does the rest.
    const Tensor d_bf16 = d.view({shape.m, shape.n});
    Tensor d_f32 = Tensor::empty({shape.m, shape.n}, DType::f32, device);
    if (args.addend.defined()) {
      run_cublaslt(device, lane, a, b, d_f32, product_only(args), shape);
      add_epilogue(d_f32, d_bf16, args.bias, args.addend, shape.m, shape.n, lane.stream);
      return;
    }
    if (args.beta != 0.0f) cast(d_bf16, d_f32);
    run_cublaslt(device, lane, a, b, d_f32, args, shape);
    cast(d_f32, d_bf16);
    return;
  }
  if (run_cublaslt(device, lane, a, b, d, args, shape)) return;
  run_mxfp8_emulated(device, a, b, d, args, shape);
}

}  // namespace octet::ops::cuda
