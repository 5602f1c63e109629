// ZeRO-1: AdamW moments sharded over the data-parallel ranks (the header has the reasoning).
#include "octet/train/zero.h"

#include <algorithm>

namespace octet::train {
namespace {

int64_t parameter_count(const TrainState& s) {
  int64_t total = 0;
  for (const Parameter& p : s.params) total += p.value.numel();
  return total;
}

}  // namespace

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<dist::Communicator> comm, TrainState& s,
                             double weight_decay)
    : comm_(std::move(comm)) {
  OCTET_CHECK(comm_ != nullptr, "ZeroOptimizer: no communicator");
  OCTET_CHECK(!s.params.empty() && s.adam_m.size() == s.params.size() &&
                  s.adam_v.size() == s.params.size(),
              "ZeroOptimizer: the train state has ", s.params.size(), " parameters and ",
              s.adam_m.size(), " moments");
  const Device device = s.params[0].value.device();
  shard_ = dist::shard_range(parameter_count(s), comm_->size(), comm_->rank());
  m_ = Tensor::empty({shard_.size()}, DType::f32, device);
  v_ = Tensor::empty({shard_.size()}, DType::f32, device);
  int64_t at = 0;  // where parameter i starts in the flat buffer
  for (size_t i = 0; i < s.params.size(); ++i) {
    const Parameter& p = s.params[i];
    const int64_t from = std::max(shard_.begin, at), to = std::min(shard_.end, at + p.value.numel());
    if (from < to) {
      const auto part = [&](const Tensor& t) { return t.view({-1}).slice(from - at, to - at); };
      const auto mine = [&](const Tensor& t) {
        return t.slice(from - shard_.begin, to - shard_.begin);
      };
      mine(m_).copy_from(part(s.adam_m[i]));
      mine(v_).copy_from(part(s.adam_v[i]));
      const float decay = p.weight_decay ? static_cast<float>(weight_decay) : 0.0f;
      pieces_.push_back({part(p.value), part(p.grad), mine(m_), mine(v_), decay});
    }
    at += p.value.numel();
  }
  release_moments(s);
}

void ZeroOptimizer::step(TrainState& s, const Tensor& norm_sq, const ops::AdamWArgs& args) {
  // A rank whose shard is empty (more ranks than parameters) updates nothing but still gathers.
  if (!pieces_.empty())
    ops::adamw_step(pieces_.data(), static_cast<int>(pieces_.size()), norm_sq, args);
  std::vector<Tensor> values;
  values.reserve(s.params.size());
  for (const Parameter& p : s.params) values.push_back(p.value);
  comm_->all_gather(values);
}

void ZeroOptimizer::gather_moments(TrainState& s) {
  for (auto* moments : {&s.adam_m, &s.adam_v}) {
    const Tensor& mine = moments == &s.adam_m ? m_ : v_;
    moments->clear();
    for (const Parameter& p : s.params)
      moments->push_back(Tensor::empty(p.value.shape(), DType::f32, p.value.device()));
    // Each rank's shard into its place in the flat buffer, then every shard to every rank.
    int64_t at = 0;
    for (const Tensor& t : *moments) {
      const int64_t from = std::max(shard_.begin, at), to = std::min(shard_.end, at + t.numel());
      if (from < to)
        t.view({-1}).slice(from - at, to - at).copy_from(
            mine.slice(from - shard_.begin, to - shard_.begin));
      at += t.numel();
    }
    comm_->all_gather(*moments);
  }
}

void ZeroOptimizer::release_moments(TrainState& s) {
  // Undefined tensors: checkpoint_tensors(s) refuses them (checkpoint.cc), so a save that forgot
  // gather_moments() fails instead of writing partial moments.
  for (Tensor& t : s.adam_m) t = Tensor();
  for (Tensor& t : s.adam_v) t = Tensor();
}

int64_t ZeroOptimizer::moment_bytes() const {
  return static_cast<int64_t>(m_.nbytes() + v_.nbytes());
}

}  // namespace octet::train
