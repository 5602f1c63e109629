#include "octet/core/error.h"

namespace octet {

Error::Error(const char* file, int line, const std::string& message)
    : std::runtime_error(detail::concat(file, ":", line, ": ", message)), message_(message) {}

Error::Error(const char* file, int line, const char* condition, const std::string& message)
    : std::runtime_error(detail::concat(file, ":", line, ": check failed: ", condition,
                                        message.empty() ? "" : ": ", message)),
      message_(message.empty() ? detail::concat("check failed: ", condition) : message) {}

}  // namespace octet
