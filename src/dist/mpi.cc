// The MPI communicator (CPU tensors) and the process's world: from_environment() and shutdown().
// Built with OCTET_WITH_MPI=1; without MPI, from_environment() refuses a multi-process launch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <vector>

#include "octet/dist/communicator.h"
#include "octet/dist/watchdog.h"
#include "octet/fp8/format.h"

#if OCTET_WITH_MPI
#include <mpi.h>
#endif

namespace octet::dist {

#if OCTET_WITH_MPI

bool built_with_mpi() { return true; }

namespace {

/// MPI counts are ints: larger buffers go in chunks of this many elements.
constexpr int64_t kMaxChunk = std::numeric_limits<int>::max();

/// Applies `call(pointer, n)` to `count` elements of `element_size` bytes at `data`, in chunks
/// of at most kMaxChunk elements.
template <typename Call>
void in_chunks(char* data, int64_t count, size_t element_size, Call&& call) {
  for (int64_t at = 0; at < count; at += kMaxChunk) {
    const int64_t n = std::min(kMaxChunk, count - at);
    call(data + static_cast<size_t>(at) * element_size, static_cast<int>(n));
  }
}

void check_cpu(const Tensor& t, const char* what) {
  OCTET_CHECK(t.device().is_cpu(), "the MPI communicator's ", what,
              " takes CPU tensors (GPU ranks use the NCCL communicator), got ",
              t.describe());
}

/// MPI_MAX over floats that keeps a NaN whatever the order: MPI's own MAX may compute
/// (a > b ? a : b), which drops a NaN on one side, so one rank's non-finite amax could vanish
/// from the reduction (or survive on some ranks only) instead of skipping the step everywhere.
void nan_propagating_max(void* in, void* inout, int* count, MPI_Datatype*) {
  const float* a = static_cast<const float*>(in);
  float* b = static_cast<float*>(inout);
  for (int i = 0; i < *count; ++i)
    if (std::isnan(a[i]) || a[i] > b[i]) b[i] = a[i];
}

/// A sum of bf16 values (as MPI_UINT16_T): each partial sum is formed in f32 and rounded to bf16
/// (round-to-nearest-even), the arithmetic of a bf16 all-reduce on the wire.
void bf16_sum(void* in, void* inout, int* count, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *count; ++i)
    b[i] = fp8::encode_bf16(fp8::decode_bf16(a[i]) + fp8::decode_bf16(b[i]));
}

/// The byte counts and offsets of the ranks' shards of a flat buffer, for MPI's v-collectives,
/// in rounds of at most kMaxChunk bytes per rank (MPI counts are ints).
template <typename Call>
void shard_rounds(int64_t total, size_t element_size, int size, Call&& call) {
  std::vector<ShardRange> shards(static_cast<size_t>(size));
  int64_t longest = 0;
  for (int r = 0; r < size; ++r) {
    shards[r] = shard_range(total, size, r);
    shards[r].begin *= static_cast<int64_t>(element_size);
    shards[r].end *= static_cast<int64_t>(element_size);
    longest = std::max(longest, shards[r].size());
  }
  std::vector<int> counts(static_cast<size_t>(size)), offsets(static_cast<size_t>(size));
  for (int64_t done = 0; done < longest; done += kMaxChunk) {
    // Offsets are relative to the lowest shard start of the round, so they fit an int too only
    // when the buffer is smaller than 2 GiB: refuse larger buffers than that per round instead.
    for (int r = 0; r < size; ++r) {
      const int64_t n = std::clamp<int64_t>(shards[r].size() - done, 0, kMaxChunk);
      const int64_t at = shards[r].begin + std::min(done, shards[r].size());
      OCTET_CHECK(at <= kMaxChunk, "the MPI communicator gathers and scatters buffers of up to ",
                  kMaxChunk, " bytes, got ", total * static_cast<int64_t>(element_size));
      counts[r] = static_cast<int>(n);
      offsets[r] = static_cast<int>(at);
    }
    call(counts.data(), offsets.data());
  }
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    OCTET_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    OCTET_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size_));
    // A failed call returns its error (OCTET_CHECK_MPI throws) instead of MPI's default of
    // ending the job from inside the library with its own message.
    OCTET_CHECK_MPI(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    OCTET_CHECK_MPI(MPI_Op_create(&nan_propagating_max, /*commute=*/1, &max_));
    OCTET_CHECK_MPI(MPI_Op_create(&bf16_sum, /*commute=*/1, &bf16_sum_));
    watchdog_ = std::make_unique<CollectiveWatchdog>(
        collective_deadline(), "rank " + std::to_string(rank_) + " of " + std::to_string(size_),
        &exit_on_expired_collective);
  }
  ~MpiCommunicator() override {
    watchdog_.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      MPI_Op_free(&max_);
      MPI_Op_free(&bf16_sum_);
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string describe() const override {
    return "mpi, " + std::to_string(size_) + (size_ == 1 ? " rank" : " ranks");
  }

  void all_reduce(std::span<const Tensor> tensors, ReduceOp op) override {
    CollectiveWatchdog::Scope watched(*watchdog_, "all_reduce");
    const DType dtype = tensors.empty() ? DType::f32 : tensors[0].dtype();
    OCTET_CHECK(dtype == DType::f32 || (dtype == DType::bf16 && op == ReduceOp::sum),
                "all_reduce takes f32 tensors (or bf16 for a sum), got ", tensors[0].describe());
    const int64_t total = flat_count(tensors, "all_reduce", dtype);
    for (const Tensor& t : tensors) check_cpu(t, "all_reduce");
    if (total == 0) return;
    const size_t element = dtype_size(dtype);
    char* data = pack(tensors, total, element);
    const MPI_Datatype type = dtype == DType::f32 ? MPI_FLOAT : MPI_UINT16_T;
    in_chunks(data, total, element, [&](char* p, int n) {
      if (op == ReduceOp::max) {
        // MAX is exact and order-free (NaN included, see nan_propagating_max): every rank
        // computes the same value.
        OCTET_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, p, n, type, max_, MPI_COMM_WORLD));
      } else {
        reduce_sum_on_root(p, n, type);
        OCTET_CHECK_MPI(MPI_Bcast(p, n, type, 0, MPI_COMM_WORLD));
      }
    });
    unpack(tensors, element, 0, total);
  }

  void reduce_scatter(std::span<const Tensor> tensors) override {
    CollectiveWatchdog::Scope watched(*watchdog_, "reduce_scatter");
    const int64_t total = flat_count(tensors, "reduce_scatter", DType::f32);
    for (const Tensor& t : tensors) check_cpu(t, "reduce_scatter");
    if (total == 0) return;
    char* data = pack(tensors, total, sizeof(float));
    // all_reduce's sum on rank 0, then each rank's shard from there: every shard is bitwise
    // what all_reduce gives (MPI_Reduce_scatter may sum each shard in another order on its own
    // rank), for half all_reduce's broadcast traffic.
    in_chunks(data, total, sizeof(float),
              [&](char* p, int n) { reduce_sum_on_root(p, n, MPI_FLOAT); });
    shard_rounds(total, sizeof(float), size_, [&](const int* counts, const int* offsets) {
      char* mine = data + offsets[rank_];
      OCTET_CHECK_MPI(MPI_Scatterv(data, counts, offsets, MPI_BYTE,
                                   rank_ == 0 ? MPI_IN_PLACE : mine, counts[rank_], MPI_BYTE, 0,
                                   MPI_COMM_WORLD));
    });
    const ShardRange mine = shard_range(total, size_, rank_);
    unpack(tensors, sizeof(float), mine.begin, mine.end);
  }

  void all_gather(std::span<const Tensor> tensors) override {
    CollectiveWatchdog::Scope watched(*watchdog_, "all_gather");
    const int64_t total = flat_count(tensors, "all_gather");
    for (const Tensor& t : tensors) check_cpu(t, "all_gather");
    if (total == 0) return;
    const size_t element = dtype_size(tensors[0].dtype());
    char* data = pack(tensors, total, element);
    shard_rounds(total, element, size_, [&](const int* counts, const int* offsets) {
      OCTET_CHECK_MPI(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_BYTE, data, counts, offsets, MPI_BYTE,
                                     MPI_COMM_WORLD));
    });
    unpack(tensors, element, 0, total);
  }

  void broadcast(std::span<const Tensor> tensors, int root) override {
    CollectiveWatchdog::Scope watched(*watchdog_, "broadcast");
    OCTET_CHECK(root >= 0 && root < size_, "broadcast root ", root, " is not a rank of ", size_);
    for (const Tensor& t : tensors) {
      check_cpu(t, "broadcast");
      in_chunks(static_cast<char*>(t.raw_data()), static_cast<int64_t>(t.nbytes()), 1,
                [&](char* p, int n) {
                  OCTET_CHECK_MPI(MPI_Bcast(p, n, MPI_BYTE, root, MPI_COMM_WORLD));
                });
    }
  }

  void barrier() override {
    CollectiveWatchdog::Scope watched(*watchdog_, "barrier");
    OCTET_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
  }

  // Not MPI_Iallreduce: it may sum in another order on each rank (all_reduce's reason to reduce
  // on rank 0). The reduction to rank 0 runs in the background (MPI_Ireduce); its broadcast
  // starts in wait_sums, once rank 0 holds the sum.
  void start_sum(const Tensor& flat) override {
    CollectiveWatchdog::Scope watched(*watchdog_, "all_reduce");
    OCTET_CHECK(flat.dtype() == DType::f32 || flat.dtype() == DType::bf16,
                "start_sum takes an f32 or bf16 tensor, got ", flat.describe());
    check_cpu(flat, "start_sum");
    const MPI_Datatype type = flat.dtype() == DType::f32 ? MPI_FLOAT : MPI_UINT16_T;
    in_chunks(static_cast<char*>(flat.raw_data()), flat.numel(), dtype_size(flat.dtype()),
              [&](char* p, int n) {
                MPI_Request request = MPI_REQUEST_NULL;
                OCTET_CHECK_MPI(MPI_Ireduce(rank_ == 0 ? MPI_IN_PLACE : p, rank_ == 0 ? p : nullptr,
                                            n, type, sum_op(type), 0, MPI_COMM_WORLD, &request));
                pending_.push_back({p, n, type, request});
              });
    // Open MPI moves a nonblocking collective on only inside MPI calls: testing the earlier
    // sums here lets them progress while the caller computes.
    for (PendingSum& s : pending_) {
      int done = 0;
      OCTET_CHECK_MPI(MPI_Test(&s.request, &done, MPI_STATUS_IGNORE));
    }
  }

  void wait_sums() override {
    if (pending_.empty()) return;
    CollectiveWatchdog::Scope watched(*watchdog_, "all_reduce");
    // In the order started, on every rank: each sum complete on rank 0, then its broadcast.
    std::vector<MPI_Request> broadcasts(pending_.size(), MPI_REQUEST_NULL);
    for (size_t i = 0; i < pending_.size(); ++i) {
      PendingSum& s = pending_[i];
      OCTET_CHECK_MPI(MPI_Wait(&s.request, MPI_STATUS_IGNORE));
      OCTET_CHECK_MPI(MPI_Ibcast(s.data, s.count, s.type, 0, MPI_COMM_WORLD, &broadcasts[i]));
    }
    pending_.clear();
    OCTET_CHECK_MPI(MPI_Waitall(static_cast<int>(broadcasts.size()), broadcasts.data(),
                                MPI_STATUSES_IGNORE));
  }

 private:
  /// A chunk of a start_sum buffer whose reduction to rank 0 is in flight.
  struct PendingSum {
    char* data;
    int count;
    MPI_Datatype type;
    MPI_Request request;
  };

  MPI_Op sum_op(MPI_Datatype type) const { return type == MPI_FLOAT ? MPI_SUM : bf16_sum_; }

  /// A float sum depends on its order, and MPI_Allreduce may sum in a different order on each
  /// rank: reduce on rank 0 (a fixed order for a fixed world size) and let the caller send the
  /// result from there, so every rank holds the same bits and the replicas never drift apart.
  void reduce_sum_on_root(char* p, int n, MPI_Datatype type) {
    OCTET_CHECK_MPI(MPI_Reduce(rank_ == 0 ? MPI_IN_PLACE : p, rank_ == 0 ? p : nullptr, n, type,
                               sum_op(type), 0, MPI_COMM_WORLD));
  }

  /// The flat buffer of `tensors`: the tensor itself when there is one, else flat_ filled with
  /// their bytes in order (one collective for all of them).
  char* pack(std::span<const Tensor> tensors, int64_t total, size_t element) {
    if (tensors.size() == 1) return static_cast<char*>(tensors[0].raw_data());
    flat_.resize(static_cast<size_t>(total) * element);
    size_t at = 0;
    for (const Tensor& t : tensors) {
      std::copy_n(static_cast<const char*>(t.raw_data()), t.nbytes(), flat_.data() + at);
      at += t.nbytes();
    }
    return flat_.data();
  }

  /// Copies elements [begin, end) of the flat buffer back into `tensors` (nothing to do when
  /// the buffer was the one tensor itself).
  void unpack(std::span<const Tensor> tensors, size_t element, int64_t begin, int64_t end) {
    if (tensors.size() == 1) return;
    int64_t at = 0;  // the flat index where the tensor starts
    for (const Tensor& t : tensors) {
      const int64_t from = std::max(begin, at), to = std::min(end, at + t.numel());
      if (from < to)
        std::copy_n(flat_.data() + from * element, (to - from) * element,
                    static_cast<char*>(t.raw_data()) + (from - at) * element);
      at += t.numel();
    }
  }

  int rank_ = 0, size_ = 1;
  MPI_Op max_ = MPI_OP_NULL, bf16_sum_ = MPI_OP_NULL;
  std::vector<char> flat_;
  std::vector<PendingSum> pending_;  ///< started by start_sum, in order
  std::unique_ptr<CollectiveWatchdog> watchdog_;
};

std::mutex world_mutex;
std::shared_ptr<Communicator> world;  ///< the MPI world, once initialized
bool initialized_here = false;        ///< this process called MPI_Init (so it finalizes)

}  // namespace

std::shared_ptr<Communicator> from_environment() {
  std::lock_guard lock(world_mutex);
  if (world) return world->size() > 1 ? world : std::make_shared<SingleProcess>();
  int initialized = 0, finalized = 0;
  OCTET_CHECK_MPI(MPI_Initialized(&initialized));
  OCTET_CHECK_MPI(MPI_Finalized(&finalized));
  OCTET_CHECK(!finalized, "MPI was already finalized in this process");
  if (!initialized) {
    if (launcher_world_size() <= 1) return std::make_shared<SingleProcess>();
    // Only the main thread calls MPI (OpenMP threads compute between the collectives).
    int provided = 0;
    OCTET_CHECK_MPI(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    initialized_here = true;
  }
  world = std::make_shared<MpiCommunicator>();
  return world->size() > 1 ? world : std::make_shared<SingleProcess>();
}

void shutdown(bool clean) {
  std::lock_guard lock(world_mutex);
  if (!initialized_here) return;
  initialized_here = false;
  world.reset();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  std::fflush(stdout);
  std::fflush(stderr);
  if (clean)
    MPI_Finalize();
  else
    MPI_Abort(MPI_COMM_WORLD, 1);
}

#else  // OCTET_WITH_MPI

bool built_with_mpi() { return false; }

std::shared_ptr<Communicator> from_environment() {
  const int size = launcher_world_size();
  if (size > 1)
    OCTET_ERROR("launched as ", size,
                " processes (mpirun), but this octet was built without MPI (OCTET_WITH_MPI=0), "
                "so each would train alone: install libopenmpi-dev (scripts/setup.sh does) and "
                "rebuild, or run a single process");
  return std::make_shared<SingleProcess>();
}

void shutdown(bool) {}

#endif  // OCTET_WITH_MPI

}  // namespace octet::dist
