// What the C API's translation units share: the handle structs, the error boundary, DLPack
// import/export and the join with the caller's stream. Nothing outside src/capi includes this.
#pragma once

#include <atomic>
#include <new>
#include <optional>
#include <string>
#include <utility>

#include "octet/core/device.h"
#include "octet/core/error.h"
#include "octet/core/tensor.h"
#include "octet/fp8/quantized_tensor.h"
#include "octet/fp8/recipe.h"
#include "octet/nn/fp8_state.h"
#include "octet/nn/linear.h"
#include "octet/nn/transformer.h"
#include "octet/octet.h"

struct octet_recipe {
  octet::fp8::Recipe recipe;
};

struct octet_registry {
  octet::nn::AmaxRegistry registry;
  std::atomic<int> open_scopes{0};  ///< autocast scopes (any thread) that use it
};

struct octet_qtensor {
  octet::fp8::QuantizedTensor q;
};

struct octet_linear {
  octet::nn::Linear module;
  std::optional<octet::nn::Norm> norm;  ///< applied to the input first (octet_linear_create_normed)
};

struct octet_saved {
  octet::nn::Linear::Saved saved;
  octet::nn::Norm::Saved norm;  ///< with a norm: its input and row statistics
  const octet_linear* owner = nullptr;
  octet_forward_mode mode = OCTET_FORWARD_TRAINING;
};

namespace octet::capi {

/// A caller's mistake found by the C API itself (not by the library below it).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// Records `message` as this thread's last error.
void set_last_error(std::string message);
/// Runs `body`, turning every exception into a status and a last-error message.
template <typename Body>
octet_status guarded(Body&& body) noexcept {
  try {
    body();
    set_last_error({});
    return OCTET_OK;
  } catch (const InvalidArgument& e) {
    set_last_error(e.message());
    return OCTET_ERROR_INVALID_ARGUMENT;
  } catch (const OutOfMemoryError& e) {
    set_last_error(e.message());
    return OCTET_ERROR_OUT_OF_MEMORY;
  } catch (const Error& e) {
    set_last_error(e.message());
    return OCTET_ERROR_RUNTIME;
  } catch (const std::bad_alloc&) {
    set_last_error("out of host memory");
    return OCTET_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(e.what());
    return OCTET_ERROR_RUNTIME;
  } catch (...) {
    set_last_error("unknown error");
    return OCTET_ERROR_RUNTIME;
  }
}

}  // namespace octet::capi

/// Throws capi::InvalidArgument (OCTET_ERROR_INVALID_ARGUMENT) unless cond holds.
#define OCTET_CAPI_CHECK(cond, ...)                                               \
  do {                                                                            \
    if (!(cond))                                                                  \
      throw ::octet::capi::InvalidArgument(__FILE__, __LINE__,                    \
                                           ::octet::detail::concat(__VA_ARGS__)); \
  } while (false)

namespace octet::capi {

/// Throws unless `handle` is non-null; `what` names the argument.
template <typename T>
T& deref(T* handle, const char* what) {
  OCTET_CAPI_CHECK(handle != nullptr, what, " must not be NULL");
  return *handle;
}

/// octet's DType for a C enum value (throws on an unknown one).
DType to_dtype(octet_dtype dtype, const char* what);
octet_dtype from_dtype(DType dtype);
Device to_device(const DLDevice& device);
DLDevice from_device(const Device& device);

/// A borrowed DLPack tensor as an octet Tensor over the same memory (no copy). `what` names the
/// argument in messages. Row-major contiguous only; u8 data stands for FP8 codes.
Tensor borrow(const DLTensor* t, const char* what);
/// An owned DLPack tensor as an octet Tensor over the same memory: its deleter runs when the last
/// Tensor using it goes away. On failure the deleter runs before the exception leaves.
Tensor adopt(DLManagedTensor* t, const char* what);
/// A new DLManagedTensor viewing t (FP8 and E8M0 as uint8). Holds t's storage until the deleter;
/// CUDA memory is released after the work queued on `stream` by then.
DLManagedTensor* export_tensor(const Tensor& t, void* stream);

/// Makes octet's stream on `device` wait for the caller's `stream`, and on destruction the
/// caller's stream wait for octet's: a call is stream-ordered on the caller's stream. `device` is
/// the current CUDA device meanwhile (the caller's comes back after), so the ops inside switch
/// nothing. Inert for the CPU.
class StreamJoin {
 public:
  StreamJoin(const Device& device, void* stream);
  ~StreamJoin();
  StreamJoin(const StreamJoin&) = delete;
  StreamJoin& operator=(const StreamJoin&) = delete;

 private:
  std::optional<DeviceGuard> guard_;  ///< CUDA only
  void* stream_;
  void* octet_stream_ = nullptr;  ///< cudaStream_t
  void* event_ = nullptr;         ///< cudaEvent_t
};

}  // namespace octet::capi
