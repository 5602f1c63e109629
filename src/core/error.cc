#include "octet/core/error.h"

namespace octet {

Error::Error(const char* file, int line, const std::string& message)
    : std::runtime_error(detail::concat(file, ":", line, ": ", message)), message_(message) {}

}  // namespace octet
