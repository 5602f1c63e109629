/* octet's C API: FP8 recipes, quantization, FP8 GEMMs and the Linear module over DLPack tensors.
 *
 * C11 and C++ alike. Every function returns an octet_status; on failure octet_last_error() gives
 * octet's message (expected vs received) for this thread. No C++ type or exception crosses it.
 *
 * Tensors. Inputs are borrowed `const DLTensor*` (valid for the call; a DLManagedTensorVersioned's
 * dl_tensor works as well), used in place: CPU or CUDA memory, row-major and contiguous (strides
 * NULL or the compact row-major ones), the element alignment of their dtype. Anything else is an
 * error, never a silent copy. octet_linear_forward alone takes ownership of its input
 * (DLManagedTensor*), because the module's saved record may keep it until backward. Outputs are new
 * DLManagedTensor*s the caller releases with their deleter; FP8 codes travel as uint8 (DLPack 0.6
 * has no FP8 dtype).
 *
 * Streams. `stream` is a cudaStream_t (NULL: the legacy default stream) and is ignored for CPU
 * tensors. octet runs its kernels on its own stream per device, ordered after the work already
 * queued on `stream`, and leaves `stream` waiting for them: the call is stream-ordered on
 * `stream` without a host synchronisation. Memory that octet hands out is freed, when its deleter
 * runs, after the work queued on the stream that the call producing it was given.
 */
#ifndef OCTET_OCTET_H_
#define OCTET_OCTET_H_

#include <dlpack/dlpack.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define OCTET_API __declspec(dllexport)
#else
#define OCTET_API __attribute__((visibility("default")))
#endif

/** The version of this API. Additions bump the minor version; a change of an existing signature
 * or meaning bumps the major. */
#define OCTET_C_API_VERSION_MAJOR 1
#define OCTET_C_API_VERSION_MINOR 2

typedef enum octet_status {
  OCTET_OK = 0,
  OCTET_ERROR_INVALID_ARGUMENT = 1, /**< a NULL handle, an unknown enum value, a bad tensor */
  OCTET_ERROR_RUNTIME = 2,          /**< octet refused the call (its message says why) */
  OCTET_ERROR_OUT_OF_MEMORY = 3,
} octet_status;

/** Element types (octet's DType order). FP8 data is stored one byte per element. */
typedef enum octet_dtype {
  OCTET_F32 = 0,
  OCTET_BF16 = 1,
  OCTET_F16 = 2,
  OCTET_E4M3 = 3,
  OCTET_E5M2 = 4,
  OCTET_E8M0 = 5,
} octet_dtype;

/** How a quantized tensor's scales map onto its data (see octet::fp8::ScalingMode). */
typedef enum octet_scaling_mode {
  OCTET_PER_TENSOR = 0,    /**< scale_inv f32[1] */
  OCTET_BLOCK_1X128 = 1,   /**< f32[rows, ceil(cols/128)] */
  OCTET_BLOCK_128X128 = 2, /**< f32[ceil(rows/128), ceil(cols/128)] */
  OCTET_MXFP8_1X32 = 3,    /**< e8m0 (uint8) [rows, ceil(cols/32)] */
} octet_scaling_mode;

typedef enum octet_fp8_format {
  OCTET_FORMAT_E4M3 = 0,   /**< E4M3 everywhere */
  OCTET_FORMAT_HYBRID = 1, /**< E4M3 forward, E5M2 gradients */
} octet_fp8_format;

typedef enum octet_amax_algo { OCTET_AMAX_MAX = 0, OCTET_AMAX_MOST_RECENT = 1 } octet_amax_algo;

typedef enum octet_forward_mode {
  OCTET_FORWARD_TRAINING = 0,  /**< records amax, registers the FP8 state */
  OCTET_FORWARD_RECOMPUTE = 1, /**< rebuilds a record bitwise with the original forward's scales */
  OCTET_FORWARD_INFERENCE = 2, /**< touches no FP8 state; its record cannot be used for backward */
} octet_forward_mode;

typedef struct octet_recipe octet_recipe;     /**< an FP8 recipe (value semantics, immutable) */
typedef struct octet_registry octet_registry; /**< the FP8 states finalized together per pass */
typedef struct octet_qtensor octet_qtensor;   /**< an FP8 tensor with its scales */
typedef struct octet_linear octet_linear;     /**< nn::Linear on one device */
typedef struct octet_saved octet_saved;       /**< what a Linear or MLP forward keeps for backward */
typedef struct octet_mlp octet_mlp;           /**< a norm and two Linears (LayerNormMLP) */

/** The message of the last failed call on this thread ("" after a successful call). Valid until
 * the next call on this thread. */
OCTET_API const char* octet_last_error(void);
/** The API version this library implements and the octet library version. Never fails. */
OCTET_API void octet_version(int* api_major, int* api_minor, const char** library_version);
/** 1 when the library was built with the CUDA backend; the number of visible GPUs. */
OCTET_API octet_status octet_cuda_info(int* built_with_cuda, int* device_count);

/* ---------------------------------------------------------------------------------------------
 * Recipes. Defaults follow Transformer Engine (docs/NUMERICS.md). */

/** DelayedScaling: margin >= 0, amax_history_len >= 1 (TE: 0, 1024, max, hybrid). */
OCTET_API octet_status octet_recipe_delayed(int margin, int amax_history_len, octet_amax_algo algo,
                                            octet_fp8_format format, octet_recipe** out);
/** CurrentScaling: the tensor's own amax (TE: no power-of-2 rounding, hybrid). */
OCTET_API octet_status octet_recipe_current(int power_of_2_scales, octet_fp8_format format,
                                            octet_recipe** out);
/** BlockScaling: 1x128 activations and gradients, 128x128 weights, E4M3, power-of-2 scales. */
OCTET_API octet_status octet_recipe_block(octet_recipe** out);
/** MXFP8BlockScaling: an E8M0 scale per 32 elements, E4M3. */
OCTET_API octet_status octet_recipe_mxfp8(octet_recipe** out);
/** A recipe from its name: "fp8-delayed", "fp8-current", "fp8-block", "fp8-mxfp8". */
OCTET_API octet_status octet_recipe_from_name(const char* name, octet_recipe** out);
/** The recipe's name (static storage). */
OCTET_API octet_status octet_recipe_name(const octet_recipe* recipe, const char** name);
/** The fields: kind (0 delayed, 1 current, 2 block, 3 mxfp8), format, margin, history length,
 * amax algorithm and power-of-2 flag. Any pointer may be NULL. */
OCTET_API octet_status octet_recipe_fields(const octet_recipe* recipe, int* kind,
                                           octet_fp8_format* format, int* margin,
                                           int* amax_history_len, octet_amax_algo* algo,
                                           int* power_of_2_scales);
OCTET_API void octet_recipe_destroy(octet_recipe* recipe);

/* ---------------------------------------------------------------------------------------------
 * FP8 autocast: the scope in which Linear modules of this thread run FP8 GEMMs. */

OCTET_API octet_status octet_registry_create(octet_registry** out);
/** Destroying a registry that an open autocast scope uses is an error (the scope stays). */
OCTET_API octet_status octet_registry_destroy(octet_registry* registry);
/** Ends a backward pass: updates the gradient scales of every state that recorded an amax. */
OCTET_API octet_status octet_registry_finalize_backward(octet_registry* registry);
/** Updates so far: forward and backward finalizes (each counts once per pass). */
OCTET_API octet_status octet_registry_update_counts(const octet_registry* registry,
                                                    int64_t* forward, int64_t* backward);

/** Opens a scope on this thread: Linear forwards run in FP8 under `recipe` and register their
 * state with `registry`. Scopes nest. The recipe is copied; the registry must outlive the scope. */
OCTET_API octet_status octet_autocast_enter(const octet_recipe* recipe, octet_registry* registry);
/** Closes this thread's innermost scope and finalizes its forward pass (once per scope). */
OCTET_API octet_status octet_autocast_exit(void);
/** The depth of this thread's open scopes (0 outside). Never fails. */
OCTET_API int octet_autocast_depth(void);

/* ---------------------------------------------------------------------------------------------
 * Quantization and FP8 GEMM. */

typedef struct octet_quantize_options {
  octet_dtype dtype; /**< OCTET_E4M3 or OCTET_E5M2 */
  octet_scaling_mode mode;
  int rowwise;           /**< write the [rows, cols] copy (default 1) */
  int columnwise;        /**< write the transposed [cols, rows] copy (default 0) */
  int power_of_2_scales; /**< 1: round scales down to a power of 2, 0: do not, -1 (the
                            default): the mode's default (yes for blocks, no for current scaling) */
  /** Per-tensor only: f32[1] on x's device, q = fp8(x * scale). NULL: current scaling, the
   * scale is fp8_max / max|x|. Must be NULL for the block modes. */
  const DLTensor* scale;
  /** Optional f32[>=1] on x's device: element 0 becomes max(element 0, max|x|). */
  const DLTensor* amax;
} octet_quantize_options;

/** E4M3, per-tensor, row-wise only, power_of_2_scales -1, no scale (current scaling), no amax. */
OCTET_API void octet_quantize_options_init(octet_quantize_options* options);

/** Quantizes the [rows, cols] matrix view of x (f32 or bf16; leading dims fold into rows). */
OCTET_API octet_status octet_quantize(const DLTensor* x, const octet_quantize_options* options,
                                      void* stream, octet_qtensor** out);
/** out (f32 or bf16; [rows, cols], or [cols, rows] for the transposed copy) = the dequantized
 * row-wise copy of q (transposed = 0) or its transposed copy (transposed = 1). */
OCTET_API octet_status octet_dequantize(const octet_qtensor* q, int transposed, const DLTensor* out,
                                        void* stream);
/** dtype (OCTET_E4M3/E5M2), mode, rows, cols, and which copies q holds. Any pointer may be NULL. */
OCTET_API octet_status octet_qtensor_info(const octet_qtensor* q, octet_dtype* dtype,
                                          octet_scaling_mode* mode, int64_t* rows, int64_t* cols,
                                          int* has_rowwise, int* has_columnwise);
/** Views (no copy) of q's codes (uint8, [rows, cols] or [cols, rows] when transposed) and of
 * their scale_inv (f32, or uint8 E8M0 codes for MXFP8). They keep q's memory alive. */
OCTET_API octet_status octet_qtensor_data(const octet_qtensor* q, int transposed, void* stream,
                                          DLManagedTensor** out);
OCTET_API octet_status octet_qtensor_scale_inv(const octet_qtensor* q, int transposed, void* stream,
                                               DLManagedTensor** out);
OCTET_API void octet_qtensor_destroy(octet_qtensor* q);

/** d [M, N] (f32 or bf16) = alpha * A [M, K] * B [N, K]^T + beta * d + bias: the TN layout
 * Hopper's FP8 tensor cores take. A is a's row-wise copy (a_transposed = 0) or its transposed copy
 * (1), likewise B; M, N, K multiples of 16; scaling modes per_tensor x per_tensor, 1x128 x
 * {1x128, 128x128} or mxfp8 x mxfp8. bias: optional [N] (f32, or bf16 for a bf16 d). fast_accum: 1
 * for Hopper's fast accumulation (forward GEMMs), 0 for split accumulation. */
OCTET_API octet_status octet_gemm_fp8(const octet_qtensor* a, int a_transposed,
                                      const octet_qtensor* b, int b_transposed,
                                      const DLTensor* bias, const DLTensor* d, float alpha,
                                      float beta, int fast_accum, void* stream);

/* ---------------------------------------------------------------------------------------------
 * Linear: y = x W^T + b with FP32 master weights, FP8 GEMMs under an autocast scope. */

/** A Linear on `device` (kDLCPU, or kDLCUDA with its ordinal), weights uniform in +-1/sqrt(in)
 * from `seed`; compute_dtype (OCTET_F32 or OCTET_BF16) is the GEMM precision outside autocast. */
OCTET_API octet_status octet_linear_create(int64_t in_features, int64_t out_features, int bias,
                                           DLDevice device, uint64_t seed,
                                           octet_dtype compute_dtype, octet_linear** out);
/** The norm a Linear may apply to its input first, as Transformer Engine's LayerNormLinear. */
typedef enum octet_norm {
  OCTET_NORM_NONE = 0,
  OCTET_NORM_LAYERNORM = 1, /* (x - mean) * rstd * gamma + beta */
  OCTET_NORM_RMSNORM = 2,   /* x * rstd * gamma */
} octet_norm;
/** A Linear whose input goes through a norm over in_features first: y = norm(x) W^T + b, with
 * FP32 gamma (ones), for LayerNorm beta (zeros), and epsilon `eps` (> 0). Under per-tensor delayed
 * scaling the norm writes the GEMM's FP8 input in its own pass, so x is read once. Every other
 * call is the Linear's: backward also adds to the norm's gradients, zero_grad zeroes them, the
 * OCTET_LINEAR_NORM_* views show the norm's tensors; the FP8 state is the GEMM's alone.
 * norm = OCTET_NORM_NONE makes a plain Linear (eps is then ignored). */
OCTET_API octet_status octet_linear_create_normed(int64_t in_features, int64_t out_features,
                                                  int bias, octet_norm norm, float eps,
                                                  DLDevice device, uint64_t seed,
                                                  octet_dtype compute_dtype, octet_linear** out);
OCTET_API void octet_linear_destroy(octet_linear* linear);
/** The Linear's norm and its epsilon: OCTET_NORM_NONE and 0 without one. Either may be NULL. */
OCTET_API octet_status octet_linear_norm_info(const octet_linear* linear, octet_norm* norm,
                                              float* eps);
/** in_features, out_features, has_bias, device. Any pointer may be NULL. */
OCTET_API octet_status octet_linear_info(const octet_linear* linear, int64_t* in_features,
                                         int64_t* out_features, int* has_bias, DLDevice* device);

/** y [..., out] (x's dtype) = x [..., in] W^T + b, or norm(x) W^T + b with a norm. x (f32 or
 * bf16, on the module's device) is consumed: octet calls its deleter (if any) exactly once, when
 * it no longer needs it, also when the call fails. mode RECOMPUTE needs `original`, the record of the forward being recomputed
 * (its scales and weight cast are reused); otherwise `original` must be NULL. *saved receives a
 * new record for octet_linear_backward (release it with octet_saved_destroy). */
OCTET_API octet_status octet_linear_forward(octet_linear* linear, DLManagedTensor* x,
                                            octet_forward_mode mode, const octet_saved* original,
                                            void* stream, DLManagedTensor** y, octet_saved** saved);
/** dx (the input's shape and dtype) from dy (the output's shape, f32 or bf16); adds dy^T x to the
 * weight gradient and the row sums of dy to the bias gradient. */
OCTET_API octet_status octet_linear_backward(octet_linear* linear, const DLTensor* dy,
                                             const octet_saved* saved, void* stream,
                                             DLManagedTensor** dx);
/** Frees the activations a record holds and keeps what recomputing it needs (its snapshot). */
OCTET_API octet_status octet_saved_release_activations(octet_saved* saved);
OCTET_API void octet_saved_destroy(octet_saved* saved);

/** Zeroes the gradients now (on_next_write = 0), or lets the next backward overwrite them instead
 * of adding to them (on_next_write = 1: no pass over the memory, and nothing queued on `stream`). */
OCTET_API octet_status octet_linear_zero_grad(octet_linear* linear, int on_next_write,
                                              void* stream);
/** The weights were changed in place (an optimizer step): the next forward casts them again. */
OCTET_API octet_status octet_linear_weights_updated(octet_linear* linear);

/** Views (no copy) of the FP32 master weight [out, in], bias [out], and their gradients; with a
 * norm, its gamma [in], beta [in] (LayerNorm) and their gradients. Writing through a weight view
 * must be followed by octet_linear_weights_updated (the norm's are read as they are). A view of a
 * tensor the Linear does not have (a bias without bias, a norm's without a norm, beta of RMSNorm)
 * is an error. The views keep the memory alive after octet_linear_destroy. */
typedef enum octet_linear_tensor {
  OCTET_LINEAR_WEIGHT = 0,
  OCTET_LINEAR_BIAS = 1,
  OCTET_LINEAR_GRAD_WEIGHT = 2,
  OCTET_LINEAR_GRAD_BIAS = 3,
  OCTET_LINEAR_NORM_WEIGHT = 4,
  OCTET_LINEAR_NORM_BIAS = 5,
  OCTET_LINEAR_GRAD_NORM_WEIGHT = 6,
  OCTET_LINEAR_GRAD_NORM_BIAS = 7,
} octet_linear_tensor;
OCTET_API octet_status octet_linear_tensor_view(const octet_linear* linear,
                                                octet_linear_tensor which, void* stream,
                                                DLManagedTensor** out);

/** The FP8 state for checkpoints, six f32 tensors by index (octet_linear_fp8_state_name):
 * 0 forward.scale [2], 1 forward.scale_inv [2], 2 forward.amax_history [len, 2] (input, weight),
 * 3 backward.scale [1], 4 backward.scale_inv [1], 5 backward.amax_history [len, 1]
 * (grad_output); len is the recipe's history length (1 for the recipes without one). The state
 * is created for `recipe` when absent (scales 1, histories 0), so a checkpoint can be restored
 * before the first forward. get: a copy on the module's device. set: copies `value` (that shape,
 * f32, any device) in and drops the cached weight cast; records of forwards still held keep the
 * scales they were made with only up to the next set, so restore before training. */
OCTET_API octet_status octet_linear_fp8_state_count(octet_linear* linear,
                                                    const octet_recipe* recipe, int* count);
OCTET_API octet_status octet_linear_fp8_state_name(int index, const char** name);
OCTET_API octet_status octet_linear_fp8_state_get(octet_linear* linear, const octet_recipe* recipe,
                                                  int index, void* stream, DLManagedTensor** out);
OCTET_API octet_status octet_linear_fp8_state_set(octet_linear* linear, const octet_recipe* recipe,
                                                  int index, const DLTensor* value, void* stream);
/** FP8 state updates applied so far (forward and backward passes). */
OCTET_API octet_status octet_linear_fp8_update_counts(const octet_linear* linear, int64_t* forward,
                                                      int64_t* backward);

/* ---------------------------------------------------------------------------------------------
 * MLP (API 1.2): y = fc2(act(fc1(norm(x)))), as Transformer Engine's LayerNormMLP. */

typedef enum octet_activation {
  OCTET_ACTIVATION_GELU = 0,   /* tanh GELU; fc1: hidden -> ffn */
  OCTET_ACTIVATION_SWIGLU = 1, /* silu(gate) * up; fc1: hidden -> 2 ffn, [gate | up] */
  OCTET_ACTIVATION_SRELU = 2,  /* max(x, 0)^2; fc1: hidden -> ffn */
} octet_activation;

/** An MLP on `device`: fc1 = Linear(hidden, ffn, or 2 ffn for SwiGLU) after the norm (or none:
 * OCTET_NORM_NONE, eps ignored), the activation, fc2 = Linear(ffn, hidden); `bias` for both
 * Linears. Weights as octet_linear_create's, fc1's from `seed` and fc2's from seed + 1. Under
 * per-tensor delayed scaling the norm writes fc1's FP8 input and the activation fc2's, each in its
 * own pass, and the activation's backward writes fc1's FP8 gradient. */
OCTET_API octet_status octet_mlp_create(int64_t hidden, int64_t ffn, int bias,
                                        octet_activation activation, octet_norm norm, float eps,
                                        DLDevice device, uint64_t seed, octet_dtype compute_dtype,
                                        octet_mlp** out);
OCTET_API void octet_mlp_destroy(octet_mlp* mlp);
/** hidden, ffn and the activation. Any pointer may be NULL. */
OCTET_API octet_status octet_mlp_info(const octet_mlp* mlp, int64_t* hidden, int64_t* ffn,
                                      octet_activation* activation);
/** The MLP's layers as Linear handles, index 0 fc1 (which carries the norm: octet_linear_norm_info
 * and the OCTET_LINEAR_NORM_* views) and 1 fc2: parameters, gradients, zero_grad,
 * weights_updated and the FP8 states go through them. They belong to the MLP and live as long as
 * it does (octet_linear_destroy ignores them). */
OCTET_API octet_status octet_mlp_linear(octet_mlp* mlp, int index, octet_linear** out);
/** y (x's shape and dtype) from x [..., hidden]; x is consumed and `original` used as in
 * octet_linear_forward. */
OCTET_API octet_status octet_mlp_forward(octet_mlp* mlp, DLManagedTensor* x,
                                         octet_forward_mode mode, const octet_saved* original,
                                         void* stream, DLManagedTensor** y, octet_saved** saved);
/** dx (x's shape and dtype) from dy; adds to the gradients of the norm and both Linears. The
 * backward frees the record's activations as it goes: afterwards the record holds what
 * recomputing it needs, as after octet_saved_release_activations, and a second backward with it
 * is an error until it is recomputed. */
OCTET_API octet_status octet_mlp_backward(octet_mlp* mlp, const DLTensor* dy, octet_saved* saved,
                                          void* stream, DLManagedTensor** dx);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* OCTET_OCTET_H_ */
