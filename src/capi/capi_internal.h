// What the C API's translation units share: the handle structs, the error boundary, DLPack
// import/export and the join with the caller's stream. Nothing outside src/capi includes this.
#pragma once

#include <atomic>
#include <memory>
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
#include "octet/nn/mlp.h"
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
  bool part_of_mlp = false;             ///< owned by an octet_mlp (octet_mlp_linear's handles)
};

struct octet_mlp {
  octet::ops::Activation activation;
  octet_linear fc1;  ///< with the MLP's norm, when it has one
  octet_linear fc2;
};

/// A Linear's or an MLP's record (the owner says whose).
struct octet_saved {
  octet::nn::Linear::Saved saved;  ///< a Linear's
  octet::nn::MLP::Saved mlp;       ///< an MLP's
  octet::nn::Norm::Saved norm;     ///< with a norm: its input and row statistics
  const void* owner = nullptr;     ///< the octet_linear or octet_mlp whose forward made it
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

/// The Linear (and its norm) that octet_linear_create_normed makes, after checking every
/// argument; octet_mlp_create builds its two layers with it.
octet_linear make_linear(int64_t in_features, int64_t out_features, int bias, octet_norm norm,
                         float eps, DLDevice device, uint64_t seed, octet_dtype compute_dtype);
/// The nn::ForwardMode of a C mode (throws on an unknown one).
nn::ForwardMode to_mode(octet_forward_mode mode);
/// The checks every module's forward makes of its arguments (x, y and saved not NULL; `original`
/// made by the same owner's training forward for a recompute, NULL otherwise), then the new
/// record: for a recompute it starts from the original's snapshots. `module` names the owner's
/// kind in messages.
std::unique_ptr<octet_saved> begin_forward(const void* owner, const DLManagedTensor* x,
                                           octet_forward_mode mode, const octet_saved* original,
                                           DLManagedTensor** y, octet_saved** saved,
                                           const char* module);
/// An MLP record reduced to what recomputing it needs: both Linears' snapshots.
inline nn::MLP::Saved snapshots_only(nn::MLP::Saved saved) {
  nn::MLP::Saved kept;
  kept.fc1 = nn::Linear::Saved::from_snapshot(std::move(saved.fc1.snapshot));
  kept.fc2 = nn::Linear::Saved::from_snapshot(std::move(saved.fc2.snapshot));
  return kept;
}
/// Checks a record given to `owner`'s backward (the module named `module`).
void check_backward_record(const void* owner, const octet_saved* saved, const char* module);

/// Releases a consumed input unless something took it over (octet_linear_forward's contract:
/// its deleter runs exactly once, also when the call fails before adopting it).
class Consumed {
 public:
  explicit Consumed(DLManagedTensor* t) : t_(t) {}
  ~Consumed() {
    if (t_ != nullptr && t_->deleter != nullptr) t_->deleter(t_);
  }
  Consumed(const Consumed&) = delete;
  Consumed& operator=(const Consumed&) = delete;
  DLManagedTensor* take() { return std::exchange(t_, nullptr); }

 private:
  DLManagedTensor* t_;
};

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
