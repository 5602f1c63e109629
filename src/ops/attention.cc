// Dispatcher of the attention family: validates arguments against the AttentionShape, then runs
// the CPU or CUDA backend through dispatch() (device guard + NVTX range). Also holds which CUDA
// path is asked for (OCTET_ATTENTION, set_attention_choice); attention.cu applies it.
#include "octet/ops/attention.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "ops/attention_backend.h"
#include "ops/dispatch.h"

namespace octet::ops {
namespace {

/// Every extent must fit the kernels' 32-bit loop counters.
constexpr int64_t kMaxExtent = INT32_MAX;

std::string shape_text(const AttentionShape& s) {
  return detail::concat("(batch=", s.batch, ", seq=", s.seq, ", heads=", s.heads,
                        ", head_dim=", s.head_dim, ")");
}

/// a * b, throwing instead of overflowing.
int64_t checked_mul(int64_t a, int64_t b, const char* op, const AttentionShape& s) {
  int64_t product = 0;
  OCTET_CHECK(!__builtin_mul_overflow(a, b, &product), op, ": attention shape ", shape_text(s),
              " overflows 64-bit element counts");
  return product;
}

void check_attention_shape(const AttentionShape& s, const char* op) {
  for (int64_t extent : {s.batch, s.seq, s.heads, s.head_dim}) {
    OCTET_CHECK(extent >= 1 && extent <= kMaxExtent, op,
                ": attention shape must have batch, seq, heads and head_dim in [1, ", kMaxExtent,
                "], got ", shape_text(s));
  }
}

/// Throws unless `t` is the 2-D token matrix [batch*seq, parts*heads*head_dim] of `s`.
void check_token_matrix(const Tensor& t, const AttentionShape& s, int64_t parts, const char* op,
                        const char* what) {
  const Shape expected{checked_mul(s.batch, s.seq, op, s),
                       checked_mul(checked_mul(parts, s.heads, op, s), s.head_dim, op, s)};
  OCTET_CHECK(t.shape() == expected, op, ": ", what, " must be [batch*seq, ",
              parts == 1 ? "" : "3*", "heads*head_dim] = ", shape_str(expected), " for ",
              shape_text(s), ", got ", t.describe());
}

/// Throws unless `t` is defined and has qkv's dtype.
void check_dtype_matches(const Tensor& t, const Tensor& qkv, const char* op, const char* what) {
  OCTET_CHECK(t.defined(), op, ": ", what, " is an undefined tensor");
  OCTET_CHECK(t.dtype() == qkv.dtype(), op, ": ", what, " must have qkv's dtype ",
              dtype_name(qkv.dtype()), ", got ", t.describe());
}

void check_lse(const Tensor& lse, const AttentionShape& s, const char* op) {
  OCTET_CHECK(lse.defined(), op, ": lse is an undefined tensor");
  const Shape expected{s.batch, s.heads, s.seq};
  OCTET_CHECK(lse.dtype() == DType::f32 && lse.shape() == expected, op,
              ": lse must be f32[batch, heads, seq] = f32", shape_str(expected), " for ",
              shape_text(s), ", got ", lse.describe());
}

/// Throws when the output `a` shares bytes with `b` (the kernels read b while writing a).
void check_disjoint(const Tensor& a, const char* a_name, const Tensor& b, const char* b_name,
                    const char* op) {
  const auto* a0 = static_cast<const char*>(a.raw_data());
  const auto* b0 = static_cast<const char*>(b.raw_data());
  const bool overlap = a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
  OCTET_CHECK(!overlap, op, ": ", a_name, " must not share memory with ", b_name, ", got ",
              a.describe(), " and ", b.describe());
}

}  // namespace

// ----------------------------------------------------------------------------
// the choice of CUDA path

namespace {

/// The choice set through the API, or kNoChoiceSet (then OCTET_ATTENTION decides).
constexpr int kNoChoiceSet = -1;
std::atomic<int> g_api_choice{kNoChoiceSet};

/// Throws unless this build has the cuDNN path, naming the remedy; `source` names who asked.
void require_cudnn_built(std::string_view source = "OCTET_ATTENTION") {
  OCTET_CHECK(cudnn_attention_built(), source,
              ": cudnn asks for cuDNN's fused attention, but this build has none: "
              "run scripts/cudnn-frontend.sh and configure with -DOCTET_WITH_CUDNN_ATTENTION=ON "
              "(needs the CUDA backend and cuDNN), or ask for auto or flash");
}

AttentionChoice env_choice() {
  // Read once: the choice must not change under a running model because the environment did.
  static const AttentionChoice choice = [] {
    const char* value = std::getenv("OCTET_ATTENTION");
    return value == nullptr || value[0] == '\0' ? AttentionChoice::automatic
                                                : parse_attention_choice(value);
  }();
  return choice;
}

}  // namespace

const char* attention_choice_name(AttentionChoice choice) {
  switch (choice) {
    case AttentionChoice::flash:
      return "flash";
    case AttentionChoice::cudnn:
      return "cudnn";
    case AttentionChoice::automatic:
      return "auto";
  }
  return "unknown";
}

AttentionChoice parse_attention_choice(std::string_view text, std::string_view source) {
  // The spellings are attention_choice_name's, so parse and print cannot drift apart.
  for (const AttentionChoice choice :
       {AttentionChoice::flash, AttentionChoice::cudnn, AttentionChoice::automatic}) {
    if (text != attention_choice_name(choice)) continue;
    if (choice == AttentionChoice::cudnn) require_cudnn_built(source);
    return choice;
  }
  OCTET_ERROR(source, ": unknown attention path '", text,
              "'; valid values: flash, cudnn, auto (default)");
}

AttentionChoice attention_choice() {
  const int set = g_api_choice.load();
  return set == kNoChoiceSet ? env_choice() : static_cast<AttentionChoice>(set);
}

void set_attention_choice(AttentionChoice choice) {
  if (choice == AttentionChoice::cudnn) require_cudnn_built();
  g_api_choice.store(static_cast<int>(choice));
}

bool cudnn_attention_built() { return OCTET_WITH_CUDNN_ATTENTION != 0; }

const char* attention_path_name(AttentionPath path) {
  switch (path) {
    case AttentionPath::flash:
      return "flash";
    case AttentionPath::cudnn:
      return "cudnn";
    case AttentionPath::simple:
      return "simple";
  }
  return "unknown";
}

#if !OCTET_WITH_CUDA
// With the CUDA backend, attention.cu defines it beside the calls it describes.
AttentionPath attention_path(const Tensor& qkv, const AttentionShape& shape) {
  OCTET_ERROR("attention_path: octet was built without CUDA, so attention has only the CPU path");
}
#endif

// ----------------------------------------------------------------------------
// the ops

void attention_forward(const Tensor& qkv, const AttentionShape& shape, const Tensor& out,
                       const Tensor& lse) {
  constexpr const char* op = "attention_forward";
  check_attention_shape(shape, op);
  check_float_activation(qkv, op, "qkv");
  check_token_matrix(qkv, shape, 3, op, "qkv");
  check_dtype_matches(out, qkv, op, "out");
  check_token_matrix(out, shape, 1, op, "out");
  check_lse(lse, shape, op);
  check_same_device({{&qkv, "qkv"}, {&out, "out"}, {&lse, "lse"}}, op);
  check_disjoint(out, "out", qkv, "qkv", op);
  check_disjoint(lse, "lse", qkv, "qkv", op);
  check_disjoint(lse, "lse", out, "out", op);

  dispatch(
      qkv.device(), op, [&] { cpu::attention_forward(qkv, shape, out, lse); },
      [&] { OCTET_CUDA_ONLY(cuda::attention_forward(qkv, shape, out, lse)); });
}

void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                        const AttentionShape& shape, const Tensor& dqkv) {
  constexpr const char* op = "attention_backward";
  check_attention_shape(shape, op);
  check_float_activation(qkv, op, "qkv");
  check_token_matrix(qkv, shape, 3, op, "qkv");
  check_dtype_matches(out, qkv, op, "out");
  check_token_matrix(out, shape, 1, op, "out");
  check_dtype_matches(dout, qkv, op, "dout");
  check_token_matrix(dout, shape, 1, op, "dout");
  check_lse(lse, shape, op);
  check_dtype_matches(dqkv, qkv, op, "dqkv");
  check_token_matrix(dqkv, shape, 3, op, "dqkv");
  check_same_device({{&qkv, "qkv"}, {&out, "out"}, {&dout, "dout"}, {&lse, "lse"}, {&dqkv, "dqkv"}},
                    op);
  for (const auto& [t, name] :
       NamedTensors{{&qkv, "qkv"}, {&out, "out"}, {&dout, "dout"}, {&lse, "lse"}}) {
    check_disjoint(dqkv, "dqkv", *t, name.c_str(), op);
  }

  dispatch(
      qkv.device(), op, [&] { cpu::attention_backward(dout, qkv, out, lse, shape, dqkv); },
      [&] { OCTET_CUDA_ONLY(cuda::attention_backward(dout, qkv, out, lse, shape, dqkv)); });
}

void rope(const Tensor& qkv, const AttentionShape& shape, float theta, bool inverse) {
  constexpr const char* op = "rope";
  check_attention_shape(shape, op);
  OCTET_CHECK(shape.head_dim % 2 == 0, op,
              ": head_dim must be even (rope rotates pairs (2i, 2i+1)), got ", shape_text(shape));
  OCTET_CHECK(std::isfinite(theta) && theta > 0.0f, op,
              ": theta must be finite and > 0 (10000 in GPT-NeoX and Llama), got ", theta);
  check_float_activation(qkv, op, "qkv");
  check_token_matrix(qkv, shape, 3, op, "qkv");

  dispatch(
      qkv.device(), op, [&] { cpu::rope(qkv, shape, theta, inverse); },
      [&] { OCTET_CUDA_ONLY(cuda::rope(qkv, shape, theta, inverse)); });
}

}  // namespace octet::ops
