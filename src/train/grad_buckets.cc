// Gradient buckets for data parallelism (the header has the semantics).
#include "octet/train/grad_buckets.h"

#include <algorithm>
#include <cmath>

#include "octet/ops/quantize.h"

namespace octet::train {
namespace {

constexpr double kBytesPerMiB = 1024.0 * 1024.0;
constexpr int64_t kGradBytes = 4;         ///< the gradients are FP32, whatever the reduce dtype
constexpr double kMaxBucketBytes = 9e18;  ///< below INT64_MAX: the byte count must fit

/// Copies `from` into `to`, rounding to `to`'s dtype when they differ (f32 <-> bf16).
void copy_values(const Tensor& from, Tensor to) {
  if (from.dtype() == to.dtype())
    to.copy_from(from);
  else
    ops::cast(from, to);
}

/// Calls fn(gradient, its place in the flat buffer) for each parameter of bucket `b`.
template <typename Fn>
void for_each_piece(const GradBucket& b, const Tensor& flat, const std::vector<Tensor>& grads,
                    Fn&& fn) {
  int64_t at = 0;
  for (size_t i = b.first; i < b.end; ++i) {
    const Tensor& g = grads[i];
    fn(g, flat.slice(at, at + g.numel()).view(g.shape()));
    at += g.numel();
  }
}

}  // namespace

int64_t grad_bucket_bytes(double mib) {
  // An option's value, not an internal invariant: the message alone, without the condition.
  if (!(std::isfinite(mib) && mib >= 0 && mib * kBytesPerMiB < kMaxBucketBytes))
    OCTET_ERROR(
        "--grad-bucket-mb takes a bucket size in MiB, 0 or more (0: one bucket after the "
        "backward), got ",
        mib);
  if (mib == 0) return 0;
  // At least a byte: a tiny size means a bucket per parameter, never "one bucket".
  return std::max<int64_t>(1, std::llround(mib * kBytesPerMiB));
}

std::vector<GradBucket> grad_bucket_layout(std::span<const int64_t> numels, int64_t bucket_bytes) {
  OCTET_CHECK(bucket_bytes >= 0, "grad_bucket_layout: bucket_bytes ", bucket_bytes, " < 0");
  std::vector<GradBucket> buckets;
  for (size_t i = numels.size(); i-- > 0;) {
    const int64_t bytes = numels[i] * kGradBytes;
    GradBucket* open = buckets.empty() ? nullptr : &buckets.back();
    if (open == nullptr ||
        (bucket_bytes > 0 && open->elements * kGradBytes + bytes > bucket_bytes)) {
      buckets.push_back({i, i + 1, 0});
      open = &buckets.back();
    }
    open->first = i;
    open->elements += numels[i];
  }
  return buckets;
}

GradBucketReducer::GradBucketReducer(std::shared_ptr<dist::Communicator> comm,
                                     std::vector<Tensor> grads, int64_t bucket_bytes, DType wire)
    : comm_(std::move(comm)), grads_(std::move(grads)), bucket_bytes_(bucket_bytes), wire_(wire) {
  OCTET_CHECK(comm_ != nullptr, "GradBucketReducer: no communicator");
  OCTET_CHECK(wire == DType::f32 || wire == DType::bf16,
              "gradients are reduced in f32 or bf16, got ", dtype_name(wire));
  std::vector<int64_t> numels;
  for (const Tensor& g : grads_) {
    OCTET_CHECK(g.dtype() == DType::f32 && g.device() == grads_[0].device(),
                "GradBucketReducer: gradients are f32 on one device, got ", g.describe(),
                " beside ", grads_[0].describe());
    numels.push_back(g.numel());
  }
  buckets_ = grad_bucket_layout(numels, bucket_bytes);
  for (const GradBucket& b : buckets_)
    flats_.push_back(Tensor::empty({b.elements}, wire, grads_[0].device()));
}

bool GradBucketReducer::serves(std::span<const Tensor> grads, int64_t bucket_bytes,
                               DType wire) const {
  if (bucket_bytes != bucket_bytes_ || wire != wire_ || grads.size() != grads_.size()) return false;
  for (size_t i = 0; i < grads.size(); ++i)
    if (grads[i].raw_data() != grads_[i].raw_data() || grads[i].numel() != grads_[i].numel())
      return false;
  return true;
}

void GradBucketReducer::gradients_ready(size_t first) {
  while (started_ < buckets_.size() && buckets_[started_].first >= first) start_next();
}

void GradBucketReducer::start_next() {
  for_each_piece(buckets_[started_], flats_[started_], grads_,
                 [](const Tensor& grad, const Tensor& piece) { copy_values(grad, piece); });
  comm_->start_sum(flats_[started_]);
  ++started_;
}

void GradBucketReducer::finish() {
  while (started_ < buckets_.size()) start_next();
  comm_->wait_sums();
  for (size_t k = 0; k < buckets_.size(); ++k)
    for_each_piece(buckets_[k], flats_[k], grads_,
                   [](const Tensor& grad, const Tensor& piece) { copy_values(piece, grad); });
  started_ = 0;
}

}  // namespace octet::train
