// The C API's recipes, autocast scopes, quantization and FP8 GEMM (include/octet/octet.h).
#include <memory>
#include <vector>

#include "capi/capi_internal.h"
#include "octet/core/device.h"
#include "octet/fp8/format.h"
#include "octet/nn/autocast.h"
#include "octet/ops/gemm.h"
#include "octet/ops/quantize.h"
#include "octet/ops/scaling.h"

using octet::capi::deref;
using octet::capi::guarded;
namespace fp8 = octet::fp8;

namespace {

/// This thread's open autocast scopes, innermost last, with the registry each one uses.
struct OpenScope {
  octet::nn::Fp8Autocast* scope;
  octet_registry* registry;
};
thread_local std::vector<OpenScope> open_scopes;

/// A new handle for a validated recipe; an invalid field is the caller's mistake.
octet_recipe* new_recipe(const fp8::Recipe& recipe) {
  try {
    recipe.validate();
  } catch (const octet::Error& e) {
    throw octet::capi::InvalidArgument(__FILE__, __LINE__, e.message());
  }
  return new octet_recipe{recipe};
}

octet_status make_recipe(const fp8::Recipe& recipe, octet_recipe** out) {
  return guarded([&] { deref(out, "out") = new_recipe(recipe); });
}

fp8::Fp8Format to_format(octet_fp8_format format) {
  OCTET_CAPI_CHECK(format == OCTET_FORMAT_E4M3 || format == OCTET_FORMAT_HYBRID,
                   "unknown octet_fp8_format ", static_cast<int>(format),
                   " (expected OCTET_FORMAT_E4M3 or OCTET_FORMAT_HYBRID)");
  return format == OCTET_FORMAT_E4M3 ? fp8::Fp8Format::e4m3 : fp8::Fp8Format::hybrid;
}

fp8::ScalingMode to_mode(octet_scaling_mode mode) {
  OCTET_CAPI_CHECK(mode >= OCTET_PER_TENSOR && mode <= OCTET_MXFP8_1X32,
                   "unknown octet_scaling_mode ", static_cast<int>(mode));
  return static_cast<fp8::ScalingMode>(mode);
}

/// The scale of per-tensor current scaling: fp8_max / max|x| (docs/NUMERICS.md).
octet::Tensor current_scale(const octet::Tensor& x, octet::DType dtype, bool power_of_2) {
  using octet::Tensor;
  Tensor amax = Tensor::zeros({1}, octet::DType::f32, x.device());
  Tensor scale = Tensor::empty({1}, octet::DType::f32, x.device());
  Tensor scale_inv = Tensor::empty({1}, octet::DType::f32, x.device());
  octet::ops::amax(x, amax);
  octet::ops::compute_current_scale(amax, scale, scale_inv, fp8::fp8_max(dtype), power_of_2);
  return scale;
}

}  // namespace

extern "C" {

void octet_version(int* api_major, int* api_minor, const char** library_version) {
  if (api_major) *api_major = OCTET_C_API_VERSION_MAJOR;
  if (api_minor) *api_minor = OCTET_C_API_VERSION_MINOR;
  if (library_version) *library_version = OCTET_LIBRARY_VERSION;
}

octet_status octet_cuda_info(int* built_with_cuda, int* device_count) {
  return guarded([&] {
    if (built_with_cuda) *built_with_cuda = octet::built_with_cuda() ? 1 : 0;
    if (device_count) *device_count = octet::cuda_device_count();
  });
}

// ------------------------------------------------------------------------------------------------
// Recipes

octet_status octet_recipe_delayed(int margin, int amax_history_len, octet_amax_algo algo,
                                  octet_fp8_format format, octet_recipe** out) {
  return guarded([&] {
    OCTET_CAPI_CHECK(algo == OCTET_AMAX_MAX || algo == OCTET_AMAX_MOST_RECENT,
                     "unknown octet_amax_algo ", static_cast<int>(algo));
    const auto a = algo == OCTET_AMAX_MAX ? fp8::AmaxAlgo::max : fp8::AmaxAlgo::most_recent;
    fp8::Recipe r = fp8::Recipe::delayed(margin, amax_history_len, a, to_format(format));
    deref(out, "out") = new_recipe(r);
  });
}

octet_status octet_recipe_current(int power_of_2_scales, octet_fp8_format format,
                                  octet_recipe** out) {
  return guarded([&] {
    fp8::Recipe r = fp8::Recipe::current(power_of_2_scales != 0, to_format(format));
    deref(out, "out") = new_recipe(r);
  });
}

octet_status octet_recipe_block(octet_recipe** out) {
  return make_recipe(fp8::Recipe::block(), out);
}

octet_status octet_recipe_mxfp8(octet_recipe** out) {
  return make_recipe(fp8::Recipe::mxfp8(), out);
}

octet_status octet_recipe_from_name(const char* name, octet_recipe** out) {
  return guarded([&] {
    OCTET_CAPI_CHECK(name != nullptr, "name must not be NULL");
    octet_recipe** target = &deref(out, "out");
    try {
      *target = new_recipe(fp8::recipe_from_name(name));
    } catch (const octet::capi::InvalidArgument&) {
      throw;
    } catch (const octet::Error& e) {
      throw octet::capi::InvalidArgument(__FILE__, __LINE__, e.message());
    }
  });
}

octet_status octet_recipe_name(const octet_recipe* recipe, const char** name) {
  return guarded([&] {
    const fp8::Recipe& r = deref(recipe, "recipe").recipe;
    deref(name, "name");
    // Names of the four kinds, in RecipeKind order (static storage for the caller).
    static const char* const names[] = {"fp8-delayed", "fp8-current", "fp8-block", "fp8-mxfp8"};
    *name = names[static_cast<int>(r.kind)];
  });
}

octet_status octet_recipe_fields(const octet_recipe* recipe, int* kind, octet_fp8_format* format,
                                 int* margin, int* amax_history_len, octet_amax_algo* algo,
                                 int* power_of_2_scales) {
  return guarded([&] {
    const fp8::Recipe& r = deref(recipe, "recipe").recipe;
    if (kind) *kind = static_cast<int>(r.kind);
    if (format)
      *format = r.format == fp8::Fp8Format::e4m3 ? OCTET_FORMAT_E4M3 : OCTET_FORMAT_HYBRID;
    if (margin) *margin = r.margin;
    if (amax_history_len) *amax_history_len = r.amax_history_len;
    if (algo)
      *algo = r.amax_compute_algo == fp8::AmaxAlgo::max ? OCTET_AMAX_MAX : OCTET_AMAX_MOST_RECENT;
    if (power_of_2_scales) *power_of_2_scales = r.power_of_2_scales ? 1 : 0;
  });
}

void octet_recipe_destroy(octet_recipe* recipe) { delete recipe; }

// ------------------------------------------------------------------------------------------------
// Registries and autocast scopes

octet_status octet_registry_create(octet_registry** out) {
  return guarded([&] {
    deref(out, "out");
    *out = new octet_registry();
  });
}

octet_status octet_registry_destroy(octet_registry* registry) {
  return guarded([&] {
    if (registry == nullptr) return;
    OCTET_CAPI_CHECK(registry->open_scopes == 0, "the registry is used by ", registry->open_scopes,
                     " open autocast scope(s): close them (octet_autocast_exit) first");
    delete registry;
  });
}

octet_status octet_registry_finalize_backward(octet_registry* registry) {
  return guarded([&] { deref(registry, "registry").registry.finalize_backward(); });
}

octet_status octet_registry_update_counts(const octet_registry* registry, int64_t* forward,
                                          int64_t* backward) {
  return guarded([&] {
    const auto& r = deref(registry, "registry").registry;
    if (forward) *forward = r.forward_update_count();
    if (backward) *backward = r.backward_update_count();
  });
}

octet_status octet_autocast_enter(const octet_recipe* recipe, octet_registry* registry) {
  return guarded([&] {
    const fp8::Recipe& r = deref(recipe, "recipe").recipe;
    octet_registry& reg = deref(registry, "registry");
    open_scopes.reserve(open_scopes.size() + 1);  // no throw after the scope exists
    open_scopes.push_back({new octet::nn::Fp8Autocast(r, reg.registry), &reg});
    ++reg.open_scopes;
  });
}

octet_status octet_autocast_exit(void) {
  return guarded([&] {
    OCTET_CAPI_CHECK(!open_scopes.empty(),
                     "octet_autocast_exit without an open scope on this thread");
    OpenScope top = open_scopes.back();
    open_scopes.pop_back();
    --top.registry->open_scopes;
    delete top.scope;  // finalizes the forward pass; a failure surfaces as this call's error
  });
}

int octet_autocast_depth(void) { return static_cast<int>(open_scopes.size()); }

// ------------------------------------------------------------------------------------------------
// Quantization and FP8 GEMM

void octet_quantize_options_init(octet_quantize_options* options) {
  if (options == nullptr) return;
  *options = octet_quantize_options{};
  options->dtype = OCTET_E4M3;
  options->mode = OCTET_PER_TENSOR;
  options->rowwise = 1;
  options->columnwise = 0;
  options->power_of_2_scales = -1;  // the mode's default
}

octet_status octet_quantize(const DLTensor* x, const octet_quantize_options* options, void* stream,
                            octet_qtensor** out) {
  return guarded([&] {
    const octet_quantize_options& o = deref(options, "options");
    deref(out, "out");
    const octet::Tensor xt = octet::capi::borrow(x, "x");
    const octet::DType dtype = octet::capi::to_dtype(o.dtype, "options.dtype");
    OCTET_CAPI_CHECK(octet::is_fp8(dtype), "options.dtype: expected OCTET_E4M3 or OCTET_E5M2, got ",
                     octet::dtype_name(dtype));
    const fp8::ScalingMode mode = to_mode(o.mode);
    OCTET_CAPI_CHECK(o.rowwise || o.columnwise,
                     "options: ask for the row-wise copy, the transposed copy or both");
    const bool per_tensor = mode == fp8::ScalingMode::per_tensor;
    OCTET_CAPI_CHECK(per_tensor || o.scale == nullptr, "options.scale: the ",
                     fp8::scaling_mode_name(mode),
                     " mode computes its scales from the data; pass no scale");
    OCTET_CAPI_CHECK(xt.ndim() >= 1 && xt.numel() > 0, "x: expected a non-empty tensor, got ",
                     xt.describe());
    octet::capi::StreamJoin join(xt.device(), stream);
    octet::ops::QuantizeArgs args;
    args.power_of_2_block_scales = o.power_of_2_scales != 0;
    if (o.amax != nullptr) args.amax = octet::capi::borrow(o.amax, "options.amax");
    if (per_tensor) {
      args.scale = o.scale != nullptr ? octet::capi::borrow(o.scale, "options.scale")
                                      : current_scale(xt, dtype, o.power_of_2_scales == 1);
    }
    auto q = std::make_unique<octet_qtensor>();
    q->q = fp8::QuantizedTensor::allocate(
        xt.rows(), xt.cols(), dtype, mode,
        fp8::Usage{.rowwise = o.rowwise != 0, .columnwise = o.columnwise != 0}, xt.device());
    octet::ops::quantize(xt, q->q, args);
    *out = q.release();
  });
}

octet_status octet_dequantize(const octet_qtensor* q, int transposed, const DLTensor* out,
                              void* stream) {
  return guarded([&] {
    const fp8::QuantizedTensor& qt = deref(q, "q").q;
    const octet::Tensor o = octet::capi::borrow(out, "out");
    OCTET_CAPI_CHECK(transposed ? qt.has_columnwise() : qt.has_rowwise(), "q holds no ",
                     transposed ? "transposed" : "row-wise", " copy to dequantize");
    octet::capi::StreamJoin join(qt.device(), stream);
    octet::ops::dequantize(qt, o, transposed != 0);
  });
}

octet_status octet_qtensor_info(const octet_qtensor* q, octet_dtype* dtype,
                                octet_scaling_mode* mode, int64_t* rows, int64_t* cols,
                                int* has_rowwise, int* has_columnwise) {
  return guarded([&] {
    const fp8::QuantizedTensor& qt = deref(q, "q").q;
    if (dtype) *dtype = octet::capi::from_dtype(qt.dtype);
    if (mode) *mode = static_cast<octet_scaling_mode>(qt.mode);
    if (rows) *rows = qt.rows;
    if (cols) *cols = qt.cols;
    if (has_rowwise) *has_rowwise = qt.has_rowwise() ? 1 : 0;
    if (has_columnwise) *has_columnwise = qt.has_columnwise() ? 1 : 0;
  });
}

static octet_status export_part(const octet_qtensor* q, int transposed, bool scales, void* stream,
                                DLManagedTensor** out) {
  return guarded([&] {
    const fp8::QuantizedTensor& qt = deref(q, "q").q;
    deref(out, "out");
    OCTET_CAPI_CHECK(transposed ? qt.has_columnwise() : qt.has_rowwise(), "q holds no ",
                     transposed ? "transposed" : "row-wise", " copy");
    const octet::Tensor& t =
        scales ? (transposed ? qt.scale_inv_t : qt.scale_inv) : (transposed ? qt.data_t : qt.data);
    *out = octet::capi::export_tensor(t, stream);
  });
}

octet_status octet_qtensor_data(const octet_qtensor* q, int transposed, void* stream,
                                DLManagedTensor** out) {
  return export_part(q, transposed, /*scales=*/false, stream, out);
}

octet_status octet_qtensor_scale_inv(const octet_qtensor* q, int transposed, void* stream,
                                     DLManagedTensor** out) {
  return export_part(q, transposed, /*scales=*/true, stream, out);
}

void octet_qtensor_destroy(octet_qtensor* q) { delete q; }

octet_status octet_gemm_fp8(const octet_qtensor* a, int a_transposed, const octet_qtensor* b,
                            int b_transposed, const DLTensor* bias, const DLTensor* d, float alpha,
                            float beta, int fast_accum, void* stream) {
  return guarded([&] {
    const fp8::QuantizedTensor& qa = deref(a, "a").q;
    const fp8::QuantizedTensor& qb = deref(b, "b").q;
    OCTET_CAPI_CHECK(a_transposed ? qa.has_columnwise() : qa.has_rowwise(), "a holds no ",
                     a_transposed ? "transposed" : "row-wise", " copy");
    OCTET_CAPI_CHECK(b_transposed ? qb.has_columnwise() : qb.has_rowwise(), "b holds no ",
                     b_transposed ? "transposed" : "row-wise", " copy");
    const octet::Tensor dt = octet::capi::borrow(d, "d");
    octet::ops::GemmArgs args;
    args.alpha = alpha;
    args.beta = beta;
    if (bias != nullptr) args.bias = octet::capi::borrow(bias, "bias");
    args.accumulation =
        fast_accum ? octet::ops::Accumulation::fast : octet::ops::Accumulation::split;
    octet::capi::StreamJoin join(dt.device(), stream);
    octet::ops::gemm(octet::ops::GemmOperand::fp8(qa, a_transposed != 0),
                     octet::ops::GemmOperand::fp8(qb, b_transposed != 0, /*transpose=*/true), dt,
                     args);
  });
}

}  // extern "C"
