// ZeRO-1: AdamW moments and FP32 masters sharded over the data-parallel ranks (the header has the
// reasoning).
#include "octet/train/zero.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "octet/ops/quantize.h"

namespace octet::train {
namespace {

/// What the step writes besides the master: the FP8 cast's copies and scales, and the weight amax
/// it records (a view of the FP8 state's history), or the bf16 copy.
void append_cast_outputs(const ParamCast& cast, std::vector<Tensor>& out) {
  if (cast.cast != nullptr) {
    const fp8::QuantizedTensor& q = *cast.cast->out;
    for (const Tensor* t :
         {&q.data, &q.scale_inv, &q.data_t, &q.scale_inv_t, &cast.cast->args.amax})
      if (t->defined()) out.push_back(*t);
  }
  if (cast.bf16_copy.defined()) out.push_back(cast.bf16_copy);
}

bool writes_cast(const ParamCast& cast) { return cast.cast != nullptr || cast.bf16_copy.defined(); }

/// The statistics' fields as floats, for a sum over the ranks in which one rank gives them and
/// the others zeros: a double travels as three floats whose sum is exactly it.
constexpr int kStatFields = 9;
void split_double(double v, float* out) {
  for (int k = 0; k < 3; ++k) {
    out[k] = static_cast<float>(v);
    v -= static_cast<double>(out[k]);  // exact: the float is v's leading bits
  }
}
double join_double(const float* in) {
  return static_cast<double>(in[0]) + static_cast<double>(in[1]) + static_cast<double>(in[2]);
}
void pack_stats(const nn::CastStats& c, float* out) {
  out[0] = c.measured ? 1.0f : 0.0f;
  out[1] = c.amax;
  out[2] = c.scale;
  split_double(c.saturated_fraction, out + 3);
  split_double(c.underflow_fraction, out + 6);
}
nn::CastStats unpack_stats(const float* in) {
  nn::CastStats c;
  c.measured = in[0] != 0.0f;
  c.amax = in[1];
  c.scale = in[2];
  c.saturated_fraction = join_double(in + 3);
  c.underflow_fraction = join_double(in + 6);
  return c;
}

}  // namespace

int64_t ZeroOptimizer::owner_cost(int64_t numel, bool master_apart) {
  return (master_apart ? 12 : 8) * numel;
}

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<dist::Communicator> comm, TrainState& s,
                             double weight_decay)
    : comm_(std::move(comm)) {
  OCTET_CHECK(comm_ != nullptr, "ZeroOptimizer: no communicator");
  OCTET_CHECK(!s.params.empty() && s.adam_m.size() == s.params.size() &&
                  s.adam_v.size() == s.params.size(),
              "ZeroOptimizer: the train state has ", s.params.size(), " parameters and ",
              s.adam_m.size(), " moments");
  layers_ = s.model->param_layers();
  OCTET_CHECK(layers_.size() == s.params.size(), "ZeroOptimizer: the model has ", layers_.size(),
              " parameters, the train state ", s.params.size());
  const bool casts_written = s.model->precision().optimizer_writes_weight_casts();
  std::vector<int64_t> costs;
  int64_t total = 0;
  for (size_t i = 0; i < s.params.size(); ++i) {
    numels_.push_back(s.params[i].value.numel());
    costs.push_back(owner_cost(numels_[i], casts_written && is_weight(i)));
    total += costs[i];
  }
  // Equal parts of the tensors' costs laid end to end; a tensor goes to the part that holds the
  // middle of its cost.
  const int64_t part = dist::shard_range(total, comm_->size(), 0).size();
  int64_t at = 0;
  for (size_t i = 0; i < s.params.size(); ++i) {
    const int64_t middle = at + costs[i] / 2;
    owners_.push_back(static_cast<int>(std::min<int64_t>(comm_->size() - 1, middle / part)));
    decay_.push_back(s.params[i].weight_decay ? static_cast<float>(weight_decay) : 0.0f);
    at += costs[i];
  }
  master_apart_.assign(s.params.size(), false);
  release(s);
}

void ZeroOptimizer::step(TrainState& s, const Tensor& norm_sq, const ops::AdamWArgs& args) {
  const std::vector<ParamCast> casts = s.model->next_casts();
  OCTET_CHECK(casts.size() == s.params.size(), "ZeroOptimizer::step: ", casts.size(),
              " weight-cast slots for ", s.params.size(), " parameters");
  const std::vector<bool> everywhere = offered_everywhere(casts);
  std::vector<ops::AdamWTensor> mine;
  for (size_t i = 0; i < s.params.size(); ++i) {
    OCTET_CHECK(!master_apart_[i] || everywhere[i], "ZeRO-1: the master of ", s.params[i].name,
                " is kept by rank ", owners_[i],
                " only, but this step writes no cast of it on every rank (a run keeps one "
                "precision)");
    if (!owns(i)) continue;
    const Parameter& p = s.params[i];
    mine.push_back(
        {p.value, p.grad, s.adam_m[i], s.adam_v[i], decay_[i], casts[i].cast, casts[i].bf16_copy});
  }
  // A rank that owns nothing (more ranks than tensors) updates nothing but still takes part.
  if (!mine.empty()) ops::adamw_step(mine.data(), static_cast<int>(mine.size()), norm_sq, args);
  for (int root = 0; root < comm_->size(); ++root) {
    std::vector<Tensor> sent;
    for (size_t i = 0; i < s.params.size(); ++i) {
      if (owners_[i] != root) continue;
      if (master_apart_[i]) {
        append_cast_outputs(casts[i], sent);
      } else {
        sent.push_back(s.params[i].value);
      }
    }
    comm_->broadcast(sent, root);
  }
  // A whole master's casts: each rank writes those it prepared itself from the value it just
  // received, as the owner's AdamW wrote its own with the update (bitwise ops::quantize and
  // ops::cast), so what each rank prepares stays its own business, as without ZeRO.
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (owns(i) || master_apart_[i]) continue;
    const ParamCast& c = casts[i];
    if (c.cast != nullptr) ops::quantize(s.params[i].value, *c.cast->out, c.cast->args);
    if (c.bf16_copy.defined()) ops::cast(s.params[i].value, c.bf16_copy);
  }
  s.model->on_weights_updated(nn::PreparedCast::written);
  // From now on these weights' casts come from their owners, which every rank prepared this step:
  // the other ranks free the masters, and every rank keeps the cast through a skipped step.
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (master_apart_[i] || !is_weight(i) || !everywhere[i]) continue;
    master_apart_[i] = true;
    layers_[i].layer->keep_cast_through_dropped_updates();
    if (owns(i)) continue;
    layers_[i].layer->release_master_weight();
    s.params[i].value = Tensor();
  }
}

// What a rank prepares depends on what its layers cast before: an MoE expert that got no rows on
// one rank has no cast there to prepare the next one from. A master goes apart only when every
// rank prepared its cast, so that every rank receives it.
std::vector<bool> ZeroOptimizer::offered_everywhere(const std::vector<ParamCast>& casts) const {
  Tensor offered = Tensor::zeros({static_cast<int64_t>(casts.size())}, DType::f32);
  for (size_t i = 0; i < casts.size(); ++i)
    if (writes_cast(casts[i])) offered.data<float>()[i] = 1.0f;
  comm_->all_reduce(std::span(&offered, 1), dist::ReduceOp::sum);  // exact: small integers
  std::vector<bool> everywhere(casts.size());
  for (size_t i = 0; i < casts.size(); ++i)
    everywhere[i] = offered.data<float>()[i] == static_cast<float>(comm_->size());
  return everywhere;
}

void ZeroOptimizer::gather(TrainState& s) {
  for (size_t i = 0; i < s.params.size(); ++i) {
    const Tensor& like = s.params[i].grad;
    for (Tensor* t : {&s.params[i].value, &s.adam_m[i], &s.adam_v[i]})
      if (!t->defined()) *t = Tensor::empty(like.shape(), DType::f32, like.device());
  }
  for (int root = 0; root < comm_->size(); ++root) {
    std::vector<Tensor> sent;
    for (size_t i = 0; i < s.params.size(); ++i) {
      if (owners_[i] != root) continue;
      if (master_apart_[i]) sent.push_back(s.params[i].value);
      sent.push_back(s.adam_m[i]);
      sent.push_back(s.adam_v[i]);
    }
    comm_->broadcast(sent, root);
  }
}

void ZeroOptimizer::release(TrainState& s) {
  // Undefined tensors: checkpoint_tensors(s) refuses them (checkpoint.cc), so a save that forgot
  // gather() fails instead of writing another rank's stale or missing values.
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (owns(i)) continue;
    s.adam_m[i] = Tensor();
    s.adam_v[i] = Tensor();
    if (master_apart_[i]) s.params[i].value = Tensor();
  }
}

std::vector<Fp8LayerStats> ZeroOptimizer::share_weight_stats(
    const TrainState& s, std::vector<Fp8LayerStats> stats) const {
  std::map<std::string, size_t> param_index;
  for (size_t i = 0; i < s.params.size(); ++i) param_index[s.params[i].name] = i;
  // Each weight's statistics from its owner alone (where its master is), zeros from the others.
  Tensor packed = Tensor::zeros({static_cast<int64_t>(stats.size()) * kStatFields}, DType::f32);
  for (size_t m = 0; m < stats.size(); ++m) {
    const auto it = param_index.find(stats[m].name + ".weight");
    OCTET_CHECK(it != param_index.end(), "ZeroOptimizer: no parameter ", stats[m].name,
                ".weight for the FP8 module's statistics");
    if (owns(it->second)) pack_stats(stats[m].weight, packed.data<float>() + m * kStatFields);
  }
  comm_->all_reduce(std::span(&packed, 1), dist::ReduceOp::sum);
  for (size_t m = 0; m < stats.size(); ++m)
    stats[m].weight = unpack_stats(packed.data<float>() + m * kStatFields);
  return stats;
}

int64_t ZeroOptimizer::moment_bytes() const {
  int64_t bytes = 0;
  for (size_t i = 0; i < owners_.size(); ++i)
    if (owns(i)) bytes += 8 * numels_[i];  // m and v, f32
  return bytes;
}

std::string ZeroOptimizer::describe(const TrainState& s) const {
  int64_t whole_bytes = 0;  // every master, f32
  for (const int64_t n : numels_) whole_bytes += 4 * n;
  char line[192];
  std::snprintf(line, sizeof line,
                "ZeRO-1 over %d ranks: FP32 masters %.1f MB and AdamW moments %.1f MB on this "
                "rank, of %.1f and %.1f MB whole",
                comm_->size(), static_cast<double>(master_bytes(s)) / 1e6,
                static_cast<double>(moment_bytes()) / 1e6, static_cast<double>(whole_bytes) / 1e6,
                static_cast<double>(2 * whole_bytes) / 1e6);
  return line;
}

}  // namespace octet::train
