// nn::Linear: y = x W^T + b with an explicit forward and backward, FP32 master weights, and FP8
// GEMMs under fp8_autocast.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "octet/core/tensor.h"
#include "octet/fp8/quantized_tensor.h"
#include "octet/fp8/recipe.h"
#include "octet/nn/cast_stats.h"
#include "octet/nn/fp8_state.h"
#include "octet/ops/gemm.h"
#include "octet/ops/grouped_gemm.h"
#include "octet/ops/norm.h"

namespace octet::nn {

/// normal: a training forward. recompute: rebuilding Saved during backward (activation
/// recompute): it uses the scales and weight cast of the original forward, records no amax and
/// updates no FP8 state, so it rebuilds exactly the same Saved bytes. inference: evaluation; under
/// fp8_autocast it computes with the state's current scales (or the cached weight cast) but
/// records no amax, registers nothing and caches no new weight cast, so the FP8 state and the
/// cast cache are left exactly as they were; its Saved cannot be used for backward.
enum class ForwardMode : uint8_t { normal, recompute, inference };

/// The weight in the format a forward computes in. Built once per optimizer step and shared by
/// every microbatch (and by the Saved records that used it); its scales belong to it, so later
/// scale updates do not change it.
struct WeightCast {
  /// What the cast was made for; a forward under another format casts again.
  struct Key {
    bool fp8 = false;
    fp8::RecipeKind kind = fp8::RecipeKind::delayed;  ///< fp8 only
    DType dtype = DType::f32;                         ///< FP8 dtype, or the compute dtype
    fp8::ScalingMode mode = fp8::ScalingMode::per_tensor;
    bool power_of_2 = false;
    friend bool operator==(const Key&, const Key&) = default;
    /// The key of a weight cast under `recipe`.
    static Key fp8_weight(const fp8::Recipe& recipe) {
      return {.fp8 = true,
              .kind = recipe.kind,
              .dtype = recipe.dtype_for(fp8::TensorRole::weight),
              .mode = recipe.mode_for(fp8::TensorRole::weight),
              .power_of_2 = recipe.power_of_2_scales};
    }
  };
  Key key;
  fp8::QuantizedTensor q;  ///< FP8: [out, in] row-wise and [in, out] transposed (for dgrad)
  /// FP8 per-tensor recipes: the scale q was cast with (f32[1]; statistics). Undefined otherwise.
  Tensor scale;
  Tensor dense;            ///< high precision: [out, in] in the compute dtype (f32: the master)
  /// The bias rounded to bf16, for bf16 outputs: cuBLASLt fuses a bias into a bf16-output GEMM
  /// (FP8 ones included) only when the bias is bf16 too; otherwise a second pass over the output
  /// adds it, which made FP8 forward GEMMs at K = 1600 run at half speed (H200, 2026-11-30).
  /// Undefined without a bias.
  Tensor bias_bf16;
};

/// Whether the optimizer wrote the casts that Linear::prepare_next_cast() prepared.
enum class PreparedCast : uint8_t { dropped, written };

/// How zero_grad clears a module's gradients.
enum class ZeroGrad : uint8_t {
  now,  ///< zeroed at once
  /// The next backward's writes overwrite them instead of accumulating (a weight-gradient GEMM
  /// with beta 0; bias and norm-gain column sums added to 0 instead of to the old values), so a
  /// training step needs no pass over the gradients: 5.9 GB of memset and 388 memset launches
  /// at GPT-2 1.5B. Until then they hold stale values: read them after a backward, or settle
  /// them first.
  on_next_write,
};

/// Linear layer on one device. Parameters, gradients, FP8 state and every intermediate live on
/// that device; inputs elsewhere are rejected.
class Linear {
 public:
  /// What a forward used beyond its input: enough to recompute its Saved bit-exactly.
  struct Snapshot {
    bool fp8 = false;
    fp8::Recipe recipe;  ///< fp8 only
    /// Per-tensor FP8 recipes: f32[1] on the layer's device, the input scale of the forward.
    /// Delayed scaling: the FP8 state's own scale, which later updates do not overwrite (they
    /// move the state to fresh storage); current scaling: computed from the input. Undefined for
    /// block/MXFP8 (their scales come from the data) and for high precision.
    Tensor input_scale;
    std::shared_ptr<const WeightCast> weight;
  };

  /// What backward needs, produced by forward.
  struct Saved {
    Snapshot snapshot;
    Shape input_shape;
    DType input_dtype = DType::f32;
    fp8::QuantizedTensor input_q;  ///< FP8: the quantized input, row-wise and transposed
    Tensor input;                  ///< high precision: the input in the compute dtype [rows, in]
    /// input_q was written by the op that produced the input (see Linear::fused_input).
    bool input_prefilled = false;

    /// A record holding only `snapshot`: pass it to forward(..., ForwardMode::recompute).
    static Saved from_snapshot(Snapshot snapshot);
    /// True once a forward filled it.
    bool filled() const {
      return input_q.has_rowwise() || input_q.has_columnwise() || input.defined();
    }
    /// Frees what only the forward GEMM read (the FP8 input's row-wise copy; backward reads the
    /// transposed one), so that a training step holds one FP8 byte per saved input element.
    void release_forward_only() {
      input_q.data = Tensor();
      input_q.scale_inv = Tensor();
    }
    /// Frees the FP8 input altogether (a high-precision input stays), for a caller that keeps
    /// what the input is made from and rebuilds it before backward (Linear::refill_input).
    void release_fp8_input() { input_q = fp8::QuantizedTensor(); }
  };

  /// Weight [out, in] uniform in +-1/sqrt(in) and bias [out] likewise, drawn from `seed`
  /// (deterministic on every platform), on `device`. compute_dtype (f32 or bf16) is the GEMM
  /// precision outside fp8_autocast.
  Linear(int64_t in_features, int64_t out_features, bool bias, const Device& device, uint64_t seed,
         DType compute_dtype = DType::f32);
  Linear(Linear&&) = default;
  Linear& operator=(Linear&&) = default;
  Linear(const Linear&) = delete;
  Linear& operator=(const Linear&) = delete;

  /// y [..., out] (x's dtype) = x [..., in] (f32 or bf16) W^T + b (b rounded to bf16 when y is
  /// bf16) + residual. Under fp8_autocast the GEMM runs in FP8 per the active recipe (whose
  /// dimensions must then be multiples of 16); otherwise in the compute dtype. Fills `saved` for
  /// backward. `residual` (optional, y's shape and dtype) is added in the GEMM's epilogue, so a
  /// residual connection costs no separate pass; with a bf16 y the product is rounded to bf16
  /// before bias and residual join it (ops::GemmArgs::addend). The gradient flowing to the
  /// residual is dy itself, which the caller routes; backward is unchanged.
  Tensor forward(const Tensor& x, Saved& saved, ForwardMode mode = ForwardMode::normal,
                 const Tensor& residual = Tensor());
  /// Fusing the input's FP8 cast into the op that produces the input (a norm, an activation):
  /// under per-tensor delayed scaling the input's scale is known before the input exists, so
  ///   auto fused = linear.fused_input(rows, dtype, saved, mode);  // starts the record
  ///   producer(..., fused ? &*fused : nullptr);                   // also writes saved.input_q
  ///   y = linear.forward(x, saved, mode);                         // uses that copy
  /// quantizes exactly as forward() would, without reading x again; x (rows x in, `dtype`) may
  /// then be undefined when nothing else needs it. Returns nullopt (and leaves `saved` alone)
  /// when this forward cannot take a fused input: not FP8, another recipe, or inference. The
  /// returned target points into `saved`: do not move `saved` until forward(). `input_q`, when
  /// given, is the buffer the cast goes to (the [rows, in] input cast of the recipe, both copies;
  /// GroupedLinear carves its experts' from one allocation); else one is allocated.
  std::optional<ops::FusedQuantize> fused_input(int64_t rows, DType dtype, Saved& saved,
                                                ForwardMode mode = ForwardMode::normal,
                                                fp8::QuantizedTensor input_q = {});
  /// Whether fused_input(..., saved, mode) would return a target now (it has no side effects).
  bool takes_fused_input(const Saved& saved, ForwardMode mode = ForwardMode::normal) const;
  /// Rebuilding the FP8 input that Saved::release_fp8_input freed, for backward: returns the
  /// target that quantizes it exactly as the training forward did (the snapshot's recipe and
  /// input scale; no amax recorded, no FP8 state touched):
  ///   auto target = linear.refill_input(saved);
  ///   ops::quantize(x, *target.out, target.args);  // or x's producer writes it (fused)
  /// where x is the forward's input, or its producer run again; a fused producer only where
  /// takes_fused_input(saved, ForwardMode::recompute). Only the transposed copy, the one backward
  /// reads, unless `rowwise` (for a producer that writes both in one pass; release_forward_only
  /// then frees the row-wise one). The target points into `saved`.
  ops::FusedQuantize refill_input(Saved& saved, bool rowwise = false);
  /// forward() writing into `y` (the output's shape and dtype, on this layer's device), for
  /// callers that own the output buffer (nn::GroupedLinear: a row range of one expert-contiguous
  /// output).
  void forward_into(const Tensor& x, const Tensor& y, Saved& saved,
                    ForwardMode mode = ForwardMode::normal, const Tensor& residual = Tensor());
  /// dx (x's shape and dtype) from dy [..., out] (f32 or bf16); accumulates grad_weight += dy^T x
  /// and grad_bias += sum over rows of dy, in FP32 with a fixed reduction order.
  Tensor backward(const Tensor& dy, const Saved& saved);
  /// backward() writing dx into `dx` (the input's shape and dtype).
  void backward_into(const Tensor& dy, const Tensor& dx, const Saved& saved);
  /// Fusing grad_output's FP8 cast (and the bias gradient) into the op that produces dy (an
  /// activation's backward), under per-tensor delayed scaling:
  ///   fp8::QuantizedTensor dy_q;
  ///   auto fused = linear.fused_grad_output(rows, saved, dy_q);
  ///   producer_backward(..., fused ? &*fused : nullptr);  // writes dy_q, adds to grad_bias
  ///   dx = fused ? linear.backward(dy_q, saved) : linear.backward(dy, saved);
  /// gives bitwise what backward(dy) gives. nullopt when the record's recipe cannot take it.
  /// An empty dy_q is allocated; an allocated one (the [rows, out] grad_output cast of the
  /// record's recipe, both copies) is written as it is.
  std::optional<ops::FusedQuantize> fused_grad_output(int64_t rows, const Saved& saved,
                                                      fp8::QuantizedTensor& dy_q);
  /// Whether fused_grad_output(..., saved, ...) would return a target now (no side effects).
  bool takes_fused_grad_output(const Saved& saved) const;
  /// backward() with grad_output already quantized (and its bias gradient added) through
  /// fused_grad_output.
  Tensor backward(const fp8::QuantizedTensor& dy_q, const Saved& saved);
  /// backward(dy_q, saved) writing dx into `dx` (the input's shape and dtype).
  void backward_into(const fp8::QuantizedTensor& dy_q, const Tensor& dx, const Saved& saved);

  /// Sets grad_weight and grad_bias to zero; with ZeroGrad::on_next_write both are overwritten
  /// by the next backward instead (see ZeroGrad).
  void zero_grad(ZeroGrad how = ZeroGrad::now);
  /// Zeroes the gradients still waiting for their write (ZeroGrad::on_next_write with no
  /// backward since): call before reading them when a backward may not have run.
  void settle_grad();
  /// The optimizer changed the master weights: the next forward casts them again, unless the
  /// optimizer wrote what prepare_next_cast() prepared (PreparedCast::written), which is then
  /// adopted. A prepared cast is dropped otherwise; a layer that keeps its cast through dropped
  /// updates (keep_cast_through_dropped_updates) keeps the cast it holds.
  void on_weights_updated(PreparedCast prepared = PreparedCast::dropped);
  /// ZeRO-1 (train/zero.h): where only one rank keeps the master, every rank must hold the same
  /// cast, so a dropped update (a skipped step, which changes no weight) leaves the cast in place
  /// instead of casting again at the next forward.
  void keep_cast_through_dropped_updates() { keep_cast_ = true; }
  /// ZeRO-1: frees the FP32 master weight on a rank that does not update it (and keeps the cast
  /// through dropped updates). From then on the layer's casts come only as prepare_next_cast()
  /// targets that another rank writes; a forward in a format the layer holds no cast for throws,
  /// and weight() is undefined.
  void release_master_weight();

  /// What the optimizer writes together with the update so that the next forward casts nothing
  /// from the FP32 masters. A null or undefined field is not prepared.
  struct NextCast {
    /// The FP8 weight cast (ops::AdamWTensor::cast). Offered when this step's cast was FP8 with
    /// a stored per-tensor scale (delayed scaling): the cast then uses the state's weight scale
    /// as it stands, which no update changes before the next step's first forward, and records
    /// the weight amax as that forward's cast would.
    const ops::FusedQuantize* weight_fp8 = nullptr;
    /// The bf16 weight of a bf16-compute layer (ops::AdamWTensor::bf16_copy).
    Tensor weight_bf16;
    /// The bf16 bias (WeightCast::bias_bf16) of a layer with a bias, with either of the above.
    Tensor bias_bf16;
  };
  /// Prepares the next step's cast when this step's forward cast the weight in a way the
  /// optimizer can reproduce (FP8 delayed per-tensor, or a dense bf16/f32 copy); returns what
  /// the optimizer must write (all empty otherwise). The caller writes every prepared field, then
  /// calls on_weights_updated(PreparedCast::written); a next forward in another format casts
  /// again. This step's cast is dropped at once (its last reader was the backward), so the
  /// optimizer never holds two.
  const NextCast& prepare_next_cast();
  /// Whether prepare_next_cast() offers the next cast in `key`'s format: FP8 under per-tensor
  /// delayed scaling (with the optimizer-cast fusion on), or a bf16 copy.
  static bool optimizer_writes_cast(const WeightCast::Key& key);
  /// GEMM batching: while `queue` is set, forward and backward append their GEMMs to *queue
  /// (after every cast they read is enqueued) instead of running them, and the caller runs the
  /// queue (ops::grouped_gemm) before reading their outputs; nullptr runs them at once again.
  /// nn::GroupedLinear batches its experts' GEMMs this way.
  void defer_gemms(std::vector<ops::GemmProblem>* queue) { deferred_gemms_ = queue; }
  /// While `out` is set, every FP8 backward measures its grad_output cast into *out (the FP8
  /// statistics); fused_grad_output() then declines, since the fused producer never writes the
  /// high-precision gradient (the unfused path gives bitwise the same result). nullptr stops.
  void measure_grad_output(CastStats* out) { grad_stats_ = out; }

  /// What the last prepare_next_cast() returned (empty after on_weights_updated()).
  const NextCast& prepared_next_cast() const { return next_targets_; }

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  const Device& device() const { return device_; }
  DType compute_dtype() const { return compute_dtype_; }
  /// FP32 master weight [out, in] (undefined after release_master_weight()) and bias [out]
  /// (undefined without bias).
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  /// FP32 gradients, accumulated across backward calls until zero_grad() (after
  /// zero_grad(ZeroGrad::on_next_write), they hold stale values until the next backward or
  /// settle_grad()).
  const Tensor& grad_weight() const { return grad_weight_; }
  const Tensor& grad_bias() const { return grad_bias_; }
  /// The FP8 state (nullptr before the first FP8 forward).
  const std::shared_ptr<FP8State>& fp8_state() const { return state_; }
  /// The FP8 state for `recipe`, created now (scales 1, zero history) when absent or made for
  /// another recipe: lets a model build and register every state before its first step.
  FP8State& ensure_fp8_state(const fp8::Recipe& recipe) { return state_for(recipe); }
  /// How many times the weight was prepared for a compute format (an FP8 cast, a BF16 cast, or
  /// adopting the FP32 master): once per optimizer step when microbatches share one format.
  int64_t weight_casts() const { return weight_casts_; }
  /// Bytes of the weight casts held now: the FP8 copies with their scales, or the bf16 copy, and
  /// the bf16 bias; the one in use and a prepared next one. 0 where the compute weight is the
  /// f32 master itself.
  int64_t weight_cast_bytes() const;

 private:
  /// The weight-gradient GEMM's arguments: beta 0 for the write that zero_grad(on_next_write)
  /// left pending (clearing it), else beta 1.
  ops::GemmArgs wgrad_args();
  /// Whether the bias gradient's next write adds to it (false once after
  /// zero_grad(ZeroGrad::on_next_write): it is overwritten).
  bool bias_grad_accumulates();
  /// Throws unless t is defined, f32/bf16, on this layer's device with last extent `features`.
  void check_activation(const Tensor& t, int64_t features, const char* what) const;
  /// The FP8 state for `recipe`, (re)built when absent or made for another recipe.
  FP8State& state_for(const fp8::Recipe& recipe);
  /// The cached weight cast for `key`, cast now when the cache is empty or for another key.
  /// Inference casts a missing one without recording its amax and without caching it.
  std::shared_ptr<const WeightCast> weight_cast(const WeightCast::Key& key,
                                                const fp8::Recipe* recipe, ForwardMode mode);
  /// A new record for a forward in `mode`: the snapshot (FP8 recipe, weight cast, and for delayed
  /// scaling the input and weight scales in use) and the state registration. `saved` holds the
  /// original snapshot for recompute.
  Saved start_record(const Saved& saved, ForwardMode mode);
  /// ops::gemm, or appended to the deferred queue (defer_gemms).
  void run_gemm(const ops::GemmOperand& a, const ops::GemmOperand& b, const Tensor& d,
                const ops::GemmArgs& args = {});
  /// The bias a GEMM into y adds: bf16 for a bf16 y (see WeightCast::bias_bf16), else the master.
  Tensor output_bias(const WeightCast& cast, const Tensor& y) const;
  /// y = x W^T + b + residual (residual: [rows, out] or undefined), for 2-D x and y.
  void forward_fp8(const Tensor& x, const Tensor& y, const Tensor& residual, ForwardMode mode,
                   Saved& saved);
  void forward_dense(const Tensor& x, const Tensor& y, const Tensor& residual, Saved& saved);
  void backward_fp8(const Tensor& dy, const Tensor& dx, const Saved& saved);
  /// dgrad into dx and wgrad into grad_weight from the quantized grad_output.
  void backward_gemms_fp8(const fp8::QuantizedTensor& dy_q, const Tensor& dx, const Saved& saved);
  void backward_dense(const Tensor& dy, const Tensor& dx, const Saved& saved);

  int64_t in_ = 0;
  int64_t out_ = 0;
  Device device_;
  DType compute_dtype_ = DType::f32;
  Tensor weight_, bias_, grad_weight_, grad_bias_;
  std::shared_ptr<FP8State> state_;
  std::shared_ptr<const WeightCast> weight_cast_;
  /// prepare_next_cast()'s cast and the optimizer's targets in it, until on_weights_updated().
  std::shared_ptr<WeightCast> next_cast_;
  ops::FusedQuantize next_fp8_target_;
  NextCast next_targets_;
  int64_t weight_casts_ = 0;
  /// The gradients wait for their overwrite (ZeroGrad::on_next_write): the next wgrad GEMM, and
  /// the next bias column sums, write instead of adding.
  bool grad_weight_unwritten_ = false;
  CastStats* grad_stats_ = nullptr;  ///< measure_grad_output()
  bool keep_cast_ = false;           ///< keep_cast_through_dropped_updates()
  std::vector<ops::GemmProblem>* deferred_gemms_ = nullptr;  ///< defer_gemms()
  bool grad_bias_unwritten_ = false;
};

}  // namespace octet::nn
