// Data parallelism for `octet train` (the header has the semantics).
#include "octet/train/data_parallel.h"

#include <sstream>

#include "octet/core/hash.h"
#include "octet/ops/quantize.h"
#include "octet/train/grad_buckets.h"

namespace octet::train {

uint64_t options_fingerprint(const TrainOptions& o) {
  std::ostringstream text;
  text.precision(17);  // doubles round-trip
  // Every field, in declaration order, separated so that "ab","c" differs from "a","bc".
  const char sep = '\x1f';
  text << o.device << sep << o.precision << sep << o.amax_history << sep << o.amax_algo << sep
       << o.margin << sep << o.fp8_format << sep << o.unfuse << sep << o.attention << sep
       << o.model << sep << o.layers << sep << o.dim << sep << o.heads << sep << o.ffn << sep
       << o.vocab << sep << o.data << sep << o.steps << sep << o.batch << sep << o.seq << sep
       << o.accum << sep << o.lr << sep
       << o.warmup << sep << o.weight_decay << sep << o.grad_clip << sep << o.seed << sep
       << o.recompute << sep << o.deterministic << sep << o.out << sep << o.save_every << sep
       << o.keep << sep << o.resume << sep << o.eval_every << sep << o.eval_batches << sep
       << o.fp8_stats_every << sep << o.log_every << sep << o.max_skips << sep << o.guard << sep
       << o.guard_skip << sep << o.guard_z << sep << o.guard_warmup << sep << o.inject << sep
       << o.zero << sep << o.grad_reduce_dtype << sep << o.grad_bucket_mb;
  return fnv1a(text.str());
}

DataParallel::DataParallel(std::shared_ptr<dist::Communicator> comm) : comm_(std::move(comm)) {
  if (!comm_) comm_ = std::make_shared<dist::SingleProcess>();
  rank_ = comm_->rank();
  size_ = comm_->size();
  loss_ = Tensor::zeros({1}, DType::f32);
  skip_ = Tensor::zeros({1}, DType::f32);
}

void DataParallel::check_run(const TrainOptions& o) const {
  // Checks of values alone come first: every rank reaches the same verdict without a collective.
  if (o.zero != 0 && o.zero != 1)
    throw dist::CollectiveError(__FILE__, __LINE__,
                                "--zero takes 0 (no sharding) or 1 (AdamW moments sharded over "
                                "the ranks), got " + std::to_string(o.zero));
  if (o.grad_reduce_dtype != "fp32" && o.grad_reduce_dtype != "bf16")
    throw dist::CollectiveError(__FILE__, __LINE__,
                                "--grad-reduce-dtype takes fp32 or bf16, got '" +
                                    o.grad_reduce_dtype + "'");
  try {
    grad_bucket_bytes(o.grad_bucket_mb);
  } catch (const Error& e) {
    throw dist::CollectiveError(__FILE__, __LINE__, e.message());
  }
  if (!active()) return;
  // Rank 0's fingerprint to everyone, then every rank's verdict to everyone: a rank whose
  // options differ knows it, and the MAX (of rank + 1 where they differ) tells the others which,
  // so all of them stop here together with the same message.
  const uint64_t mine = options_fingerprint(o);
  Tensor theirs = Tensor::empty({1}, DType::i64);
  *theirs.data<int64_t>() = static_cast<int64_t>(mine);
  comm_->broadcast(std::span(&theirs, 1), 0);
  const bool same = static_cast<uint64_t>(*theirs.data<int64_t>()) == mine;
  // Ranks are far below 2^24: exact in f32.
  Tensor differing = Tensor::from_vector({same ? 0.0f : static_cast<float>(rank_ + 1)}, {1});
  comm_->all_reduce(std::span(&differing, 1), dist::ReduceOp::max);
  if (const int last = static_cast<int>(*differing.data<float>()); last != 0)
    throw dist::CollectiveError(
        __FILE__, __LINE__,
        "the " + std::to_string(size_) + " ranks were not given the same options (rank " +
            std::to_string(last - 1) +
            "'s differ from rank 0's): launch every rank with the same octet train command line");
  if (o.accum % size_ != 0)
    throw dist::CollectiveError(
        __FILE__, __LINE__,
        "--accum " + std::to_string(o.accum) + " counts the microbatches of a step over all " +
            std::to_string(size_) + " ranks, so it must be a multiple of the world size " +
            std::to_string(size_) + ": use --accum " + std::to_string(size_) + " (or a multiple)");
  if (o.guard || o.guard_skip)
    throw dist::CollectiveError(__FILE__, __LINE__,
                                "--guard is not supported with more than one rank yet (each rank "
                                "sees only its own microbatches' gradients): run without it");
}

void DataParallel::set_grad_reduce_dtype(const std::string& name) {
  OCTET_CHECK(name == "fp32" || name == "bf16", "--grad-reduce-dtype takes fp32 or bf16, got '",
              name, "'");
  grad_reduce_dtype_ = name == "bf16" ? DType::bf16 : DType::f32;
}

GradientReadyHook* DataParallel::gradient_hook(std::span<const Parameter> params,
                                               double bucket_mb) {
  const int64_t bytes = grad_bucket_bytes(bucket_mb);
  if (!active() || bytes == 0) {
    buckets_.reset();
    return nullptr;
  }
  std::vector<Tensor> grads;
  for (const Parameter& p : params) grads.push_back(p.grad);
  // Made again for another model (a test trains several with one DataParallel) or option.
  if (!buckets_ || !buckets_->serves(grads, bytes, grad_reduce_dtype_))
    buckets_ = std::make_unique<GradBucketReducer>(comm_, std::move(grads), bytes,
                                                   grad_reduce_dtype_);
  return buckets_.get();
}

size_t DataParallel::bucket_count() const { return buckets_ ? buckets_->buckets().size() : 1; }

double DataParallel::reduce_gradients(std::span<const Tensor> grads, double loss) {
  if (!active()) return loss;
  if (buckets_) {
    OCTET_CHECK(buckets_->serves(grads, buckets_->bucket_bytes(), buckets_->wire()),
                "reduce_gradients: these gradients are not the ones gradient_hook was given");
    buckets_->finish();
    return sum_loss(loss);
  }
  if (grad_reduce_dtype_ == DType::bf16) {
    // Each gradient rounded to bf16 into one flat buffer on its device, summed in bf16 (rank 0's
    // order), widened back: every rank gets the same bits. The loss goes in f32 on its own.
    int64_t total = 0;
    for (const Tensor& g : grads) total += g.numel();
    if (!grads.empty() && (bf16_flat_.numel() != total || bf16_flat_.device() != grads[0].device()))
      bf16_flat_ = Tensor::empty({total}, DType::bf16, grads[0].device());
    int64_t at = 0;
    for (const Tensor& g : grads) {
      ops::cast(g, bf16_flat_.slice(at, at + g.numel()).view(g.shape()));
      at += g.numel();
    }
    comm_->all_reduce(std::span(&bf16_flat_, 1), dist::ReduceOp::sum);
    at = 0;
    for (const Tensor& g : grads) {
      ops::cast(bf16_flat_.slice(at, at + g.numel()).view(g.shape()), g);
      at += g.numel();
    }
    return sum_loss(loss);
  }
  // The loss rides at the end of the gradients' buffer: one collective per step.
  *loss_.data<float>() = static_cast<float>(loss);
  std::vector<Tensor> tensors(grads.begin(), grads.end());
  tensors.push_back(loss_);
  comm_->all_reduce(tensors, dist::ReduceOp::sum);
  return static_cast<double>(*loss_.data<float>());
}

double DataParallel::sum_loss(double loss) {
  *loss_.data<float>() = static_cast<float>(loss);
  comm_->all_reduce(std::span(&loss_, 1), dist::ReduceOp::sum);
  return static_cast<double>(*loss_.data<float>());
}

void DataParallel::agree(StepVerdict& verdict) {
  if (!active()) return;
  // SkipReason values are small integers: exact in f32, and MAX picks one reason for everyone.
  *skip_.data<float>() = static_cast<float>(verdict.skip);
  comm_->all_reduce(std::span(&skip_, 1), dist::ReduceOp::max);
  verdict.skip = static_cast<SkipReason>(static_cast<int>(*skip_.data<float>()));
}

std::shared_ptr<nn::AmaxReducer> DataParallel::amax_reducer() const {
  return active() ? dist::make_amax_reducer(comm_) : nullptr;
}

}  // namespace octet::train
