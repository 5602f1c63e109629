// The MPI communicator (CPU tensors) and the process's world: from_environment() and shutdown().
// Built with OCTET_WITH_MPI=1; without MPI, from_environment() refuses a multi-process launch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <vector>

#include "octet/dist/communicator.h"

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
              " takes CPU tensors (GPU ranks need the NCCL communicator, not built yet), got ",
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

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    OCTET_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    OCTET_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size_));
    OCTET_CHECK_MPI(MPI_Op_create(&nan_propagating_max, /*commute=*/1, &max_));
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Op_free(&max_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string describe() const override {
    return "mpi, " + std::to_string(size_) + (size_ == 1 ? " rank" : " ranks");
  }

  void all_reduce(std::span<const Tensor> tensors, ReduceOp op) override {
    int64_t total = 0;
    for (const Tensor& t : tensors) {
      OCTET_CHECK(t.dtype() == DType::f32, "all_reduce takes f32 tensors, got ", t.describe());
      check_cpu(t, "all_reduce");
      total += t.numel();
    }
    if (total == 0) return;
    // One tensor is reduced in place; several go through one flat buffer (one collective).
    float* data = nullptr;
    if (tensors.size() == 1) {
      data = tensors[0].data<float>();
    } else {
      flat_.resize(static_cast<size_t>(total));
      size_t at = 0;
      for (const Tensor& t : tensors) {
        std::copy_n(t.data<float>(), t.numel(), flat_.data() + at);
        at += static_cast<size_t>(t.numel());
      }
      data = flat_.data();
    }
    in_chunks(reinterpret_cast<char*>(data), total, sizeof(float), [&](char* p, int n) {
      if (op == ReduceOp::max) {
        // MAX is exact and order-free (NaN included, see nan_propagating_max): every rank
        // computes the same value.
        OCTET_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, p, n, MPI_FLOAT, max_, MPI_COMM_WORLD));
      } else {
        // A float sum depends on its order, and MPI_Allreduce may sum in a different order on
        // each rank: reduce on rank 0 (a fixed order for a fixed world size), then broadcast,
        // so every rank holds the same bits and the replicas never drift apart.
        OCTET_CHECK_MPI(MPI_Reduce(rank_ == 0 ? MPI_IN_PLACE : p, rank_ == 0 ? p : nullptr, n,
                                   MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD));
        OCTET_CHECK_MPI(MPI_Bcast(p, n, MPI_FLOAT, 0, MPI_COMM_WORLD));
      }
    });
    if (tensors.size() > 1) {
      size_t at = 0;
      for (const Tensor& t : tensors) {
        std::copy_n(flat_.data() + at, t.numel(), t.data<float>());
        at += static_cast<size_t>(t.numel());
      }
    }
  }

  void broadcast(std::span<const Tensor> tensors, int root) override {
    OCTET_CHECK(root >= 0 && root < size_, "broadcast root ", root, " is not a rank of ", size_);
    for (const Tensor& t : tensors) {
      check_cpu(t, "broadcast");
      in_chunks(static_cast<char*>(t.raw_data()), static_cast<int64_t>(t.nbytes()), 1,
                [&](char* p, int n) {
                  OCTET_CHECK_MPI(MPI_Bcast(p, n, MPI_BYTE, root, MPI_COMM_WORLD));
                });
    }
  }

  void barrier() override { OCTET_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD)); }

 private:
  int rank_ = 0, size_ = 1;
  MPI_Op max_ = MPI_OP_NULL;
  std::vector<float> flat_;
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
