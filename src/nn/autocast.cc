#include "octet/nn/autocast.h"

#include <exception>

namespace octet::nn {
namespace {
thread_local const Fp8Context* current_context = nullptr;
}  // namespace

const Fp8Context* active_fp8() { return current_context; }

Fp8Autocast::Fp8Autocast(const fp8::Recipe& recipe, AmaxRegistry& registry)
    : context_{recipe, &registry},
      previous_(current_context),
      uncaught_at_entry_(std::uncaught_exceptions()) {
  recipe.validate();
  current_context = &context_;
}

Fp8Autocast::~Fp8Autocast() noexcept(false) {
  current_context = previous_;
  // Unwinding: the pass did not complete, so it gets no update (and a destructor must not throw
  // while an exception is in flight).
  if (std::uncaught_exceptions() > uncaught_at_entry_) return;
  context_.registry->finalize_forward();
}

}  // namespace octet::nn
