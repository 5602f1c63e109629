// fp8_autocast: the scope in which modules run their GEMMs in FP8 under a recipe.
#pragma once

#include <optional>

#include "octet/fp8/recipe.h"
#include "octet/nn/fp8_state.h"

namespace octet::nn {

/// The recipe and registry of the innermost active Fp8Autocast of this thread.
struct Fp8Context {
  fp8::Recipe recipe;
  AmaxRegistry* registry = nullptr;
};

/// The active FP8 context of this thread, or nullptr outside every Fp8Autocast (modules then run
/// in their high-precision compute dtype).
const Fp8Context* active_fp8();

/// RAII: `Fp8Autocast scope(recipe, registry);` makes modules in this thread run FP8 GEMMs under
/// `recipe` and register their FP8 states with `registry`. Scopes nest; the previous context
/// comes back at the end of the scope.
///
/// The destructor calls registry.finalize_forward(): a forward pass is one scope. When the scope
/// is left by an exception it does not finalize: the pass did not complete, and its partial
/// amaxes stay in history row 0 until the next finalize (the caller may also discard them).
class Fp8Autocast {
 public:
  Fp8Autocast(const fp8::Recipe& recipe, AmaxRegistry& registry);
  /// May throw: a failed finalize surfaces here rather than being lost.
  ~Fp8Autocast() noexcept(false);
  Fp8Autocast(const Fp8Autocast&) = delete;
  Fp8Autocast& operator=(const Fp8Autocast&) = delete;

 private:
  Fp8Context context_;
  const Fp8Context* previous_;
  int uncaught_at_entry_;
};

}  // namespace octet::nn
