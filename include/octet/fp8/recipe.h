// FP8 recipes: which format and which scaling each tensor role gets. docs/NUMERICS.md has the
// formulas. Defaults follow Transformer Engine so its users meet no surprises.
#pragma once

#include <string>
#include <string_view>

#include "octet/core/dtype.h"
#include "octet/fp8/quantized_tensor.h"

namespace octet::fp8 {

/// The tensors an FP8 GEMM module quantizes. input and weight belong to the forward pass,
/// grad_output to the backward pass.
enum class TensorRole : uint8_t { input = 0, weight = 1, grad_output = 2 };
inline constexpr int kForwardRoles = 2;   ///< input, weight
inline constexpr int kBackwardRoles = 1;  ///< grad_output
std::string_view role_name(TensorRole role);
constexpr bool is_forward_role(TensorRole r) { return r != TensorRole::grad_output; }
/// Index of the role inside its pass's ScalingGroup.
constexpr int role_slot(TensorRole r) { return r == TensorRole::grad_output ? 0 : static_cast<int>(r); }

enum class RecipeKind : uint8_t { delayed, current, block, mxfp8 };
/// e4m3: E4M3 everywhere. hybrid: E4M3 forward, E5M2 for gradients.
enum class Fp8Format : uint8_t { e4m3, hybrid };
/// How delayed scaling reduces the amax history.
enum class AmaxAlgo : uint8_t { max, most_recent };

/// One plain struct for all four recipes; fields that a kind does not use are ignored.
struct Recipe {
  RecipeKind kind = RecipeKind::delayed;
  Fp8Format format = Fp8Format::hybrid;
  int margin = 0;                           ///< delayed: scale /= 2^margin
  int amax_history_len = 1024;              ///< delayed: rows of the history (1..)
  AmaxAlgo amax_compute_algo = AmaxAlgo::max;
  bool power_of_2_scales = false;           ///< current: round scales down to a power of 2

  /// DelayedScaling: margin 0, HYBRID, history 1024, max.
  static Recipe delayed(int margin = 0, int history_len = 1024, AmaxAlgo algo = AmaxAlgo::max,
                        Fp8Format format = Fp8Format::hybrid);
  /// CurrentScaling: the tensor's own amax, HYBRID.
  static Recipe current(bool power_of_2_scales = false, Fp8Format format = Fp8Format::hybrid);
  /// BlockScaling: 1x128 activations and gradients, 128x128 weights, E4M3, power-of-2 scales.
  static Recipe block();
  /// MXFP8BlockScaling: 1x32 E8M0 blocks, E4M3 everywhere.
  static Recipe mxfp8();

  /// FP8 dtype for a role (E5M2 for grad_output under HYBRID).
  DType dtype_for(TensorRole role) const;
  /// Scaling mode for a role.
  ScalingMode mode_for(TensorRole role) const;
  /// Throws octet::Error on an invalid field (history length < 1, negative margin, ...).
  void validate() const;
  /// "fp8-delayed", "fp8-current", "fp8-block", "fp8-mxfp8".
  std::string name() const;
  /// The fields the kind uses, e.g. "hybrid, amax history 1024 (max), margin 0" for delayed
  /// scaling: for run headers and checkpoint metadata (two recipes of one kind differ in it
  /// exactly when they compute differently).
  std::string describe() const;
};

/// "e4m3" / "hybrid", and the inverse (throws on anything else).
std::string_view format_name(Fp8Format format);
Fp8Format format_from_name(std::string_view name);
/// "max" / "most_recent", and the inverse (throws on anything else).
std::string_view amax_algo_name(AmaxAlgo algo);
AmaxAlgo amax_algo_from_name(std::string_view name);

/// Inverse of Recipe::name() with default parameters; throws on an unknown name.
Recipe recipe_from_name(std::string_view name);

}  // namespace octet::fp8
