// octet::Error and the check macros. Library code throws; it never calls exit().
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace octet {

/// The exception type thrown by octet. what() holds "file:line: message" (and, from a failed
/// OCTET_CHECK, the condition too); message() is what a user is shown.
class Error : public std::runtime_error {
 public:
  Error(const char* file, int line, const std::string& message);
  /// A failed OCTET_CHECK of `condition`: what() is "file:line: check failed: condition:
  /// message"; message() is the message alone, or "check failed: condition" when it is empty.
  Error(const char* file, int line, const char* condition, const std::string& message);
  /// The message without the file:line prefix (nor a check's condition).
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

/// A device allocation failed: callers that know what the memory was for (the trainer) add
/// advice; everyone else treats it as an Error.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace octet

/// Throws octet::Error with the streamed message parts.
#define OCTET_ERROR(...) throw ::octet::Error(__FILE__, __LINE__, ::octet::detail::concat(__VA_ARGS__))

/// Throws octet::Error unless cond holds. The message names what was expected and received, in
/// words a user can act on: it is all that the CLI, the C API and Python show (what() also
/// names the condition, for the developer).
#define OCTET_CHECK(cond, ...)                                                               \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      throw ::octet::Error(__FILE__, __LINE__, #cond, ::octet::detail::concat(__VA_ARGS__)); \
    }                                                                                        \
  } while (false)

/// Throws octet::Error naming the MPI error and the failed call. Expands to MPI calls: use it
/// only where <mpi.h> is included (src/dist).
#define OCTET_CHECK_MPI(call)                                                    \
  do {                                                                           \
    const int octet_mpi_status_ = (call);                                        \
    if (octet_mpi_status_ != MPI_SUCCESS) {                                      \
      char octet_mpi_text_[MPI_MAX_ERROR_STRING];                                \
      int octet_mpi_length_ = 0;                                                 \
      MPI_Error_string(octet_mpi_status_, octet_mpi_text_, &octet_mpi_length_);  \
      OCTET_ERROR("MPI error (", std::string(octet_mpi_text_, octet_mpi_length_), \
                  ") in ", #call);                                               \
    }                                                                            \
  } while (false)
