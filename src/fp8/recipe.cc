#include "octet/fp8/recipe.h"

#include <array>

#include "octet/core/error.h"

namespace octet::fp8 {
namespace {

/// Longest amax history accepted. TE's default is 1024; 2^16 rows keeps a per-module history
/// (rows x 3 roles x 4 bytes) under 1 MiB while leaving room far above any recipe seen in practice.
constexpr int kMaxAmaxHistoryLen = 1 << 16;

struct KindName {
  RecipeKind kind;
  std::string_view name;
};
constexpr std::array<KindName, 4> kKindNames{{
    {RecipeKind::delayed, "fp8-delayed"},
    {RecipeKind::current, "fp8-current"},
    {RecipeKind::block, "fp8-block"},
    {RecipeKind::mxfp8, "fp8-mxfp8"},
}};

bool valid_role(TensorRole role) {
  return role == TensorRole::input || role == TensorRole::weight || role == TensorRole::grad_output;
}

}  // namespace

std::string_view role_name(TensorRole role) {
  switch (role) {
    case TensorRole::input:
      return "input";
    case TensorRole::weight:
      return "weight";
    case TensorRole::grad_output:
      return "grad_output";
  }
  return "?";
}

Recipe Recipe::delayed(int margin, int history_len, AmaxAlgo algo, Fp8Format format) {
  Recipe r;
  r.kind = RecipeKind::delayed;
  r.format = format;
  r.margin = margin;
  r.amax_history_len = history_len;
  r.amax_compute_algo = algo;
  return r;
}

Recipe Recipe::current(bool power_of_2_scales, Fp8Format format) {
  Recipe r;
  r.kind = RecipeKind::current;
  r.format = format;
  r.power_of_2_scales = power_of_2_scales;
  return r;
}

Recipe Recipe::block() {
  Recipe r;
  r.kind = RecipeKind::block;
  r.format = Fp8Format::e4m3;
  r.power_of_2_scales = true;  // the DeepSeek-V3 recipe's power-of-2 tile scales
  return r;
}

Recipe Recipe::mxfp8() {
  Recipe r;
  r.kind = RecipeKind::mxfp8;
  r.format = Fp8Format::e4m3;
  return r;
}

DType Recipe::dtype_for(TensorRole role) const {
  OCTET_CHECK(valid_role(role), "unknown tensor role code ", static_cast<int>(role));
  // The format decides for every kind (as in TE, block and MXFP8 recipes may be HYBRID too);
  // the block and mxfp8 factories choose E4M3.
  return format == Fp8Format::hybrid && role == TensorRole::grad_output ? DType::e5m2 : DType::e4m3;
}

ScalingMode Recipe::mode_for(TensorRole role) const {
  OCTET_CHECK(valid_role(role), "unknown tensor role code ", static_cast<int>(role));
  switch (kind) {
    case RecipeKind::delayed:
    case RecipeKind::current:
      return ScalingMode::per_tensor;
    case RecipeKind::block:
      return role == TensorRole::weight ? ScalingMode::block_128x128 : ScalingMode::block_1x128;
    case RecipeKind::mxfp8:
      return ScalingMode::mxfp8_1x32;
  }
  OCTET_ERROR("unknown recipe kind code ", static_cast<int>(kind));
}

void Recipe::validate() const {
  OCTET_CHECK(kind == RecipeKind::delayed || kind == RecipeKind::current ||
                  kind == RecipeKind::block || kind == RecipeKind::mxfp8,
              "unknown recipe kind code ", static_cast<int>(kind));
  OCTET_CHECK(format == Fp8Format::e4m3 || format == Fp8Format::hybrid, "unknown FP8 format code ",
              static_cast<int>(format), "; expected e4m3 or hybrid");
  if (kind != RecipeKind::delayed) return;  // the remaining fields are delayed scaling's
  OCTET_CHECK(amax_history_len >= 1 && amax_history_len <= kMaxAmaxHistoryLen,
              "amax_history_len must be in [1, ", kMaxAmaxHistoryLen, "], got ", amax_history_len);
  OCTET_CHECK(margin >= 0, "margin must be >= 0 (scale is divided by 2^margin), got ", margin);
  OCTET_CHECK(amax_compute_algo == AmaxAlgo::max || amax_compute_algo == AmaxAlgo::most_recent,
              "unknown amax_compute_algo code ", static_cast<int>(amax_compute_algo),
              "; expected max or most_recent");
}

std::string Recipe::name() const {
  for (const auto& k : kKindNames)
    if (k.kind == kind) return std::string(k.name);
  OCTET_ERROR("unknown recipe kind code ", static_cast<int>(kind));
}

std::string Recipe::describe() const {
  std::string out(format_name(format));
  switch (kind) {
    case RecipeKind::delayed:
      out += ", amax history " + std::to_string(amax_history_len) + " (" +
             std::string(amax_algo_name(amax_compute_algo)) + "), margin " +
             std::to_string(margin);
      break;
    case RecipeKind::current:
    case RecipeKind::block:
      if (power_of_2_scales) out += ", power-of-2 scales";
      break;
    case RecipeKind::mxfp8:
      break;
  }
  return out;
}

std::string_view format_name(Fp8Format format) {
  return format == Fp8Format::e4m3 ? "e4m3" : "hybrid";
}

Fp8Format format_from_name(std::string_view name) {
  if (name == "e4m3") return Fp8Format::e4m3;
  if (name == "hybrid") return Fp8Format::hybrid;
  OCTET_ERROR("unknown FP8 format '", name,
              "'; expected hybrid (E4M3 forward, E5M2 gradients) or e4m3 (E4M3 everywhere)");
}

std::string_view amax_algo_name(AmaxAlgo algo) {
  return algo == AmaxAlgo::max ? "max" : "most_recent";
}

AmaxAlgo amax_algo_from_name(std::string_view name) {
  if (name == "max") return AmaxAlgo::max;
  if (name == "most_recent") return AmaxAlgo::most_recent;
  OCTET_ERROR("unknown amax algorithm '", name, "'; expected max or most_recent");
}

Recipe recipe_from_name(std::string_view name) {
  for (const auto& k : kKindNames) {
    if (k.name != name) continue;
    switch (k.kind) {
      case RecipeKind::delayed:
        return Recipe::delayed();
      case RecipeKind::current:
        return Recipe::current();
      case RecipeKind::block:
        return Recipe::block();
      case RecipeKind::mxfp8:
        return Recipe::mxfp8();
    }
  }
  OCTET_ERROR("unknown recipe '", name,
              "'; expected fp8-delayed, fp8-current, fp8-block or fp8-mxfp8");
}

}  // namespace octet::fp8
