// Gradient buckets for data parallelism (--grad-bucket-mb): the gradients are summed over the
// ranks in buckets of consecutive parameters, each bucket started (Communicator::start_sum) as
// soon as the step's last backward has finished writing it, so the reduction overlaps the rest
// of the backward; the optimizer waits for all of them (finish()).
//
// Results. A bucket's sum is all_reduce(sum)'s element for element: every element is reduced on
// rank 0 and broadcast, so every rank holds the same bits and the sum of an element does not
// depend on the bucket it lands in. For two ranks that is a + b, bitwise the single collective's
// (tests/dist/grad_bucket_test.cc). For more ranks the library picks the order of each sum (MPI
// and NCCL choose their reduction algorithm by message size), so bucketed and single-collective
// runs may differ in the last bit, while every rank still holds the same value.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "octet/core/tensor.h"
#include "octet/dist/communicator.h"
#include "octet/train/model.h"

namespace octet::train {

/// Parameters [first, end) of parameters() order, `elements` gradient values in all.
struct GradBucket {
  size_t first = 0, end = 0;
  int64_t elements = 0;
};

/// The bytes of --grad-bucket-mb `mib`; throws unless it is a finite number >= 0.
int64_t grad_bucket_bytes(double mib);

/// The buckets of parameters of `numels` elements (parameters() order): consecutive parameters
/// from the last to the first (the order the backward finishes them), a bucket closed before its
/// FP32 gradients would pass `bucket_bytes` (a larger parameter gets a bucket of its own);
/// `bucket_bytes` 0: one bucket of every parameter. A pure function: the same on every rank.
std::vector<GradBucket> grad_bucket_layout(std::span<const int64_t> numels, int64_t bucket_bytes);

/// Sums the gradients over `comm`'s ranks bucket by bucket: one flat buffer per bucket (in the
/// reduce dtype, on the gradients' device), one collective per bucket.
class GradBucketReducer final : public GradientReadyHook {
 public:
  /// `grads`: parameters() order, FP32 on one device. `wire`: f32, or bf16 (each gradient
  /// rounded to bf16, summed in bf16: DataParallel::set_grad_reduce_dtype).
  GradBucketReducer(std::shared_ptr<dist::Communicator> comm, std::vector<Tensor> grads,
                    int64_t bucket_bytes, DType wire);

  /// Starts the sum of every bucket whose parameters are all from `first` on, in bucket order.
  void gradients_ready(size_t first) override;
  /// Starts the buckets not started yet, waits for every sum, and writes the sums into the
  /// gradients; the next step starts from the first bucket again. Collective.
  void finish();

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  int64_t bucket_bytes() const { return bucket_bytes_; }
  DType wire() const { return wire_; }
  /// Whether this reducer was made for these gradients (the same tensors), sizes and dtype.
  bool serves(std::span<const Tensor> grads, int64_t bucket_bytes, DType wire) const;

 private:
  void start_next();

  std::shared_ptr<dist::Communicator> comm_;
  std::vector<Tensor> grads_;
  int64_t bucket_bytes_;
  DType wire_;
  std::vector<GradBucket> buckets_;
  std::vector<Tensor> flats_;  ///< one per bucket, parameters in parameters() order
  size_t started_ = 0;         ///< buckets started this step
};

}  // namespace octet::train
