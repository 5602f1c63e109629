#include "octet/core/determinism.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "octet/core/error.h"

namespace octet {
namespace {
std::atomic<bool> g_api_deterministic{false};

bool env_deterministic() {
  const char* value = std::getenv("OCTET_DETERMINISTIC");
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}
}  // namespace

bool deterministic() { return g_api_deterministic.load() || env_deterministic(); }

void set_deterministic(bool on) { g_api_deterministic.store(on); }

void check_deterministic_supported(const char* op, const char* remedy) {
  if (deterministic())
    OCTET_ERROR(op, " has no deterministic implementation, but determinism was requested "
                "(OCTET_DETERMINISTIC or set_deterministic); ", remedy);
}

}  // namespace octet
