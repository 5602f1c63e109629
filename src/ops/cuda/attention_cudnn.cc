// The cuDNN path of CUDA attention: cuDNN's fused scaled dot-product attention (SDPA), described
// as a cudnn-frontend graph, built once per device and shape, then executed on octet's stream.
// Compiled with the CUDA backend; the cuDNN code only when OCTET_WITH_CUDNN_ATTENTION (CMake puts
// the frontend's headers on this file alone).
//
// Layout: no copies. Q, K and V are the three parts of the packed qkv rows, described to cuDNN as
// [B, H, T, D] tensors with strides {T*3*H*D, D, 3*H*D, 1} starting 0, H*D and 2*H*D elements into
// qkv; O and dO as [B, H, T, D] with strides {T*H*D, D, H*D, 1} over out and dout; dQ, dK and dV
// land in dqkv the way Q, K and V are read from qkv. cuDNN's Stats, f32 [B, H, T, 1] packed, is
// our lse [B, H, T]: the natural-log log-sum-exp of the scaled scores per query (the frontend
// offers base 2 only on request, set_stats_use_log2, which this file never sets).
//
// Determinism: the forward has no cross-CTA reduction; the backward is built with
// set_deterministic_algorithm(true), which on Hopper makes cuDNN accumulate dQ through a dP
// workspace in a fixed order instead of with float atomics (workspace of about
// B*H*T_padded^2*2 bytes, taken from octet's allocator like every other buffer).
#include "ops/cuda/attention_cudnn.h"

#include <cstdint>

#if OCTET_WITH_CUDNN_ATTENTION
// The frontend's JSON (plan serialization, logging) is unused here, and its bundled
// nlohmann::json would otherwise sit beside the one octet links.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "octet/core/device.h"
#endif

namespace octet::ops::cuda {
namespace {

/// cuDNN's SDPA takes head dims that are multiples of 8 up to 128 on every architecture it
/// supports (Hopper goes to 256, the others do not; flash stops at 128 too).
constexpr int64_t kCudnnHeadDimMultiple = 8;
constexpr int64_t kCudnnMaxHeadDim = 128;

}  // namespace

bool cudnn_attention_fits(const AttentionShape& s, DType dtype, bool aligned) {
  return cudnn_attention_built() && dtype == DType::bf16 && aligned &&
         s.head_dim % kCudnnHeadDimMultiple == 0 && s.head_dim <= kCudnnMaxHeadDim;
}

#if OCTET_WITH_CUDNN_ATTENTION

namespace {

namespace fe = cudnn_frontend;

/// Throws octet::Error naming the cuDNN status and the failed call.
#define OCTET_CHECK_CUDNN(call)                                                             \
  do {                                                                                      \
    const cudnnStatus_t octet_cudnn_status_ = (call);                                       \
    if (octet_cudnn_status_ != CUDNN_STATUS_SUCCESS) {                                      \
      OCTET_ERROR("cuDNN error ", cudnnGetErrorString(octet_cudnn_status_), " in ", #call); \
    }                                                                                       \
  } while (false)

enum class Pass { forward, backward };

std::string describe(Pass pass, const AttentionShape& s) {
  return detail::concat("attention_", pass == Pass::forward ? "forward" : "backward",
                        " (cuDNN path, B=", s.batch, " T=", s.seq, " H=", s.heads,
                        " D=", s.head_dim, ")");
}

/// Throws octet::Error when a frontend step failed, with the frontend's own explanation.
void check_frontend(fe::error_t status, const char* step, Pass pass, const AttentionShape& s) {
  OCTET_CHECK(status.is_good(), describe(pass, s), ": cudnn-frontend ", step, " failed (code ",
              static_cast<int>(status.get_code()), "): ", status.get_message(),
              "; OCTET_ATTENTION=flash runs octet's own kernels instead");
}

/// The graphs' tensor ids: the keys of the pointer map handed to execute().
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

using Dims = std::vector<int64_t>;

Dims bhtd(const AttentionShape& s) { return {s.batch, s.heads, s.seq, s.head_dim}; }
/// One of q, k, v (or dq, dk, dv) inside packed [B*T, 3*H*D] rows.
Dims packed_qkv_strides(const AttentionShape& s) {
  const int64_t row = 3 * s.heads * s.head_dim;
  return {s.seq * row, s.head_dim, row, 1};
}
/// out or dout: [B*T, H*D] rows.
Dims token_strides(const AttentionShape& s) {
  const int64_t row = s.heads * s.head_dim;
  return {s.seq * row, s.head_dim, row, 1};
}
Dims stats_dims(const AttentionShape& s) { return {s.batch, s.heads, s.seq, 1}; }
Dims stats_strides(const AttentionShape& s) { return {s.heads * s.seq, s.seq, 1, 1}; }

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& graph, const char* name,
                                                    Uid uid, Dims dims, Dims strides) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim(std::move(dims))
                          .set_stride(std::move(strides)));
}

void mark_output(fe::graph::Tensor_attributes& t, Uid uid, Dims dims, Dims strides) {
  t.set_output(true).set_uid(uid).set_dim(std::move(dims)).set_stride(std::move(strides));
}

/// bf16 in and out, f32 for the scores, softmax and accumulators.
std::shared_ptr<fe::graph::Graph> new_graph() {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

/// Describes the forward: O and Stats (the lse) from Q, K, V, causal, scaled by `scale`.
void describe_forward(fe::graph::Graph& graph, const AttentionShape& s, float scale) {
  auto q = input(graph, "q", kQ, bhtd(s), packed_qkv_strides(s));
  auto k = input(graph, "k", kK, bhtd(s), packed_qkv_strides(s));
  auto v = input(graph, "v", kV, bhtd(s), packed_qkv_strides(s));
  // Causal: query i sees keys j <= i (the band's right bound 0 from the top-left diagonal).
  auto options = fe::graph::SDPA_attributes()
                     .set_name("octet_attention_forward")
                     .set_generate_stats(true)
                     .set_attn_scale(scale)
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0);
  auto [o, stats] = graph.sdpa(q, k, v, options);
  mark_output(*o, kO, bhtd(s), token_strides(s));
  mark_output(*stats, kStats, stats_dims(s), stats_strides(s));
  stats->set_data_type(fe::DataType_t::FLOAT);
}

/// Describes the backward: dQ, dK, dV from Q, K, V, O, dO and Stats, deterministic.
void describe_backward(fe::graph::Graph& graph, const AttentionShape& s, float scale) {
  auto q = input(graph, "q", kQ, bhtd(s), packed_qkv_strides(s));
  auto k = input(graph, "k", kK, bhtd(s), packed_qkv_strides(s));
  auto v = input(graph, "v", kV, bhtd(s), packed_qkv_strides(s));
  auto o = input(graph, "o", kO, bhtd(s), token_strides(s));
  auto d_o = input(graph, "dO", kDO, bhtd(s), token_strides(s));
  auto stats = input(graph, "stats", kStats, stats_dims(s), stats_strides(s));
  stats->set_data_type(fe::DataType_t::FLOAT);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("octet_attention_backward")
                     .set_attn_scale(scale)
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0)
                     .set_deterministic_algorithm(true);  // attention.h: no float atomics
  auto [dq, dk, dv] = graph.sdpa_backward(q, k, v, o, d_o, stats, options);
  mark_output(*dq, kDQ, bhtd(s), packed_qkv_strides(s));
  mark_output(*dk, kDK, bhtd(s), packed_qkv_strides(s));
  mark_output(*dv, kDV, bhtd(s), packed_qkv_strides(s));
}

/// A built graph and the workspace its plan needs, or why cuDNN built none (a refusal is kept
/// too, so that auto asks cuDNN once per shape).
struct BuiltGraph {
  std::shared_ptr<fe::graph::Graph> graph;  ///< null when refused
  int64_t workspace_bytes = 0;
  std::string refusal;
};

using GraphKey = std::tuple<int, int64_t, int64_t, int64_t, int64_t, Pass>;  // device, B, T, H, D

/// Every device's cuDNN handle (null until its first call) and the built graphs, under the mutex.
/// Never destroyed, like octet's streams and cuBLASLt handles: attention may run during static
/// destruction.
struct CudnnState {
  std::mutex mutex;
  std::vector<cudnnHandle_t> handles;
  std::map<GraphKey, BuiltGraph> graphs;
};
CudnnState& cudnn_state() {
  static auto* state = new CudnnState;
  return *state;
}

/// The device's handle, created on first use with that device current. Caller holds the mutex.
cudnnHandle_t handle_for(CudnnState& state, const Device& device) {
  if (state.handles.empty()) state.handles.resize(std::max(cuda_device_count(), 1), nullptr);
  check_device_available(device);
  cudnnHandle_t& handle = state.handles[device.index];
  if (handle == nullptr) {
    DeviceGuard guard(device);
    cudnnHandle_t created = nullptr;  // the slot stays null when creation fails
    OCTET_CHECK_CUDNN(cudnnCreate(&created));
    handle = created;
  }
  return handle;
}

/// The graph of (device, shape, pass), built (or refused) on first use. Caller holds the mutex.
const BuiltGraph& graph_for(CudnnState& state, const Device& device, const AttentionShape& s,
                            Pass pass, float scale) {
  const GraphKey key{device.index, s.batch, s.seq, s.heads, s.head_dim, pass};
  if (auto found = state.graphs.find(key); found != state.graphs.end()) return found->second;
  cudnnHandle_t handle = handle_for(state, device);
  BuiltGraph built{new_graph(), 0, ""};
  try {
    if (pass == Pass::forward) {
      describe_forward(*built.graph, s, scale);
    } else {
      describe_backward(*built.graph, s, scale);
    }
    // Heuristics mode A, then the fallback list; the first plan that builds is kept for the
    // process, so one shape always runs one kernel.
    check_frontend(built.graph->build(handle, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
                   "build", pass, s);
    check_frontend(built.graph->get_workspace_size(built.workspace_bytes), "get_workspace_size",
                   pass, s);
  } catch (const Error& e) {
    built = {nullptr, 0, e.what()};
  } catch (const std::exception& e) {  // the frontend also throws (cudnnException)
    built = {nullptr, 0, describe(pass, s) + ": cudnn-frontend threw: " + e.what()};
  }
  return state.graphs.emplace(key, std::move(built)).first->second;
}

/// Runs the (device, shape, pass) graph on `stream` with `pointers` (uid -> address).
void execute(const Device& device, const AttentionShape& s, Pass pass, float scale,
             std::unordered_map<int64_t, void*> pointers, cudaStream_t stream) {
  CudnnState& state = cudnn_state();
  // Held through execute: the handle's stream is per handle, and the handle is per device.
  std::lock_guard lock(state.mutex);
  const BuiltGraph& built = graph_for(state, device, s, pass, scale);
  OCTET_CHECK(built.graph != nullptr, built.refusal);
  cudnnHandle_t handle = handle_for(state, device);
  // Stream-ordered like every octet buffer: freed after the kernels that use it.
  Tensor workspace;
  if (built.workspace_bytes > 0) {
    workspace = Tensor::empty({built.workspace_bytes}, DType::u8, device);
  }
  OCTET_CHECK_CUDNN(cudnnSetStream(handle, stream));
  check_frontend(
      built.graph->execute(handle, pointers, workspace.defined() ? workspace.raw_data() : nullptr),
      "execute", pass, s);
}

/// The addresses of q, k and v (or dq, dk, dv) inside packed rows.
struct PackedParts {
  void* q;
  void* k;
  void* v;
};
PackedParts packed_parts(const Tensor& packed, const AttentionShape& s) {
  auto* base = static_cast<char*>(packed.raw_data());
  const int64_t part_bytes = s.heads * s.head_dim * static_cast<int64_t>(dtype_size(DType::bf16));
  return {base, base + part_bytes, base + 2 * part_bytes};
}

}  // namespace

bool cudnn_attention_builds(const Device& device, const AttentionShape& s, bool backward,
                            float scale) {
  CudnnState& state = cudnn_state();
  std::lock_guard lock(state.mutex);
  return graph_for(state, device, s, backward ? Pass::backward : Pass::forward, scale).graph !=
         nullptr;
}

void attention_forward_cudnn(const Tensor& qkv, const AttentionShape& s, const Tensor& out,
                             const Tensor& lse, float scale, cudaStream_t stream) {
  const PackedParts in = packed_parts(qkv, s);
  execute(qkv.device(), s, Pass::forward, scale,
          {{kQ, in.q}, {kK, in.k}, {kV, in.v}, {kO, out.raw_data()}, {kStats, lse.raw_data()}},
          stream);
}

void attention_backward_cudnn(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, const AttentionShape& s, const Tensor& dqkv,
                              float scale, cudaStream_t stream) {
  const PackedParts in = packed_parts(qkv, s);
  const PackedParts grad = packed_parts(dqkv, s);
  execute(qkv.device(), s, Pass::backward, scale,
          {{kQ, in.q},
           {kK, in.k},
           {kV, in.v},
           {kO, out.raw_data()},
           {kDO, dout.raw_data()},
           {kStats, lse.raw_data()},
           {kDQ, grad.q},
           {kDK, grad.k},
           {kDV, grad.v}},
          stream);
}

#else  // !OCTET_WITH_CUDNN_ATTENTION: cudnn_attention_fits is false, so these are never chosen.

bool cudnn_attention_builds(const Device&, const AttentionShape&, bool, float) { return false; }

void attention_forward_cudnn(const Tensor&, const AttentionShape&, const Tensor&, const Tensor&,
                             float, cudaStream_t) {
  OCTET_ERROR("attention_forward: built without OCTET_WITH_CUDNN_ATTENTION");
}
void attention_backward_cudnn(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const AttentionShape&, const Tensor&, float, cudaStream_t) {
  OCTET_ERROR("attention_backward: built without OCTET_WITH_CUDNN_ATTENTION");
}

#endif

}  // namespace octet::ops::cuda
