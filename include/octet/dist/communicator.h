// The dist layer: a Communicator over the processes of a data-parallel run, and the FP8 amax
// reduction over it. MPI serves CPU ranks, NCCL GPU ranks (nccl.h). Nothing below this layer
// knows it exists: nn sees an AmaxReducer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "octet/core/error.h"
#include "octet/core/tensor.h"
#include "octet/nn/fp8_state.h"

namespace octet::dist {

/// The element-wise reductions of all_reduce.
enum class ReduceOp : uint8_t { sum, max };

/// Rank `rank`'s part [begin, end) of a flat buffer of `total` elements split over `size` ranks
/// (ZeRO's shards): equal parts of ceil(total / size) elements, the last ones shorter or empty.
struct ShardRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
ShardRange shard_range(int64_t total, int size, int rank);

/// An error that every rank raised at the same point, after agreeing on it through a collective
/// (mismatched options, a world size that does not divide the accumulation). A process that
/// catches one may shut MPI down cleanly (shutdown(true)): the other ranks are doing the same.
class CollectiveError : public Error {
 public:
  using Error::Error;
};

/// The processes of one group (the world, for data parallelism). Every collective must be called
/// by every rank, in the same order, with tensors of the same shapes.
class Communicator {
 public:
  virtual ~Communicator() = default;
  /// This process's index in the group, 0 .. size() - 1.
  virtual int rank() const = 0;
  /// The number of processes in the group.
  virtual int size() const = 0;
  /// "mpi, 2 ranks"; "single process".
  virtual std::string describe() const = 0;
  /// Reduces `tensors`, treated as one flat buffer in the given order, element-wise over the
  /// group, in place. Every rank ends with bitwise the same values (a sum is reduced on one rank
  /// in a fixed order and broadcast, not summed independently on each). f32 for both ops; bf16
  /// for sums (each partial sum rounded to bf16: half the bytes of f32, see data_parallel.h).
  virtual void all_reduce(std::span<const Tensor> tensors, ReduceOp op) = 0;
  /// Sums f32 `tensors` (one flat buffer, as all_reduce) over the group, leaving this rank's
  /// shard_range(total, size(), rank()) of the buffer bitwise equal to what all_reduce(sum)
  /// leaves there; the rest of the buffer is unspecified afterwards.
  virtual void reduce_scatter(std::span<const Tensor> tensors) = 0;
  /// The inverse: every rank's shard_range of the flat buffer of `tensors` (one dtype, any) is
  /// copied into the same range on every other rank, so all end with the whole buffer.
  virtual void all_gather(std::span<const Tensor> tensors) = 0;
  /// Copies the bytes of `tensors` (any dtype) on rank `root` into the same tensors on the others.
  virtual void broadcast(std::span<const Tensor> tensors, int root = 0) = 0;
  /// Returns when every rank has called it.
  virtual void barrier() = 0;

  /// Starts all_reduce(sum) of `flat` (one f32 or bf16 tensor on this communicator's device, the
  /// CPU for MPI) and may return before it completes: the tensor must be neither read nor
  /// written until wait_sums() returns. Every element gets the bits all_reduce(sum) gives it
  /// (reduced on rank 0, broadcast), wherever the buffer's boundaries fall. Every rank starts the
  /// same sums in the same order; other collectives may run between start and wait. On a GPU
  /// the sum runs after the work already queued on the device's stream, on a stream of its own.
  /// The default reduces at once.
  virtual void start_sum(const Tensor& flat);
  /// Returns when every started sum is complete (on a GPU: the device's stream also waits for
  /// them before its next work), with the deadline and errors of any collective.
  virtual void wait_sums() {}
};

/// The group of one process: collectives leave the tensors as they are.
class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string describe() const override { return "single process"; }
  void all_reduce(std::span<const Tensor> tensors, ReduceOp op) override;
  void reduce_scatter(std::span<const Tensor> tensors) override;
  void all_gather(std::span<const Tensor> tensors) override;
  void broadcast(std::span<const Tensor> tensors, int root = 0) override;
  void barrier() override {}
};

/// The element count of `tensors` as one flat buffer; throws unless they share `dtype` (when
/// given) or, without it, one dtype among them. `what` names the collective in the message.
int64_t flat_count(std::span<const Tensor> tensors, const char* what,
                   std::optional<DType> dtype = std::nullopt);

/// True when this build has the MPI communicator (OCTET_WITH_MPI).
bool built_with_mpi();

/// The number of processes the launcher started, from its environment (OMPI_COMM_WORLD_SIZE,
/// PMI_SIZE); 1 when there is none.
int launcher_world_size();

/// The world this process runs in: MPI_COMM_WORLD when launched by mpirun with more than one
/// process (or when MPI is already initialized with more than one), else a SingleProcess. The MPI
/// communicator is one per process (MPI initializes once): every call returns the same one.
/// With `device` a CUDA device and more than one rank (mpirun, or torchrun's RANK/WORLD_SIZE),
/// the NCCL communicator on that device instead (nccl.h; MPI or a TCP socket shares its id).
/// Throws when launched with several processes by a build without MPI (or NCCL, for CUDA).
std::shared_ptr<Communicator> from_environment();
std::shared_ptr<Communicator> from_environment(const Device& device);

/// The devices `devices` ("cpu", "cuda", "cuda:N", or a list: a model split over them) name for
/// this rank. In a launch of several ranks plain "cuda" is the GPU of this rank's local rank
/// (bootstrap.h: launcher_local_rank()), and a list is local rank 0's: rank r adds r x (the
/// list's largest GPU index + 1) to each GPU index, so `cuda:0,1` puts rank 0 on GPUs 0 and 1
/// and rank 1 on 2 and 3 (CPU entries stay). One device is taken as named.
std::vector<Device> devices_for_this_rank(const std::string& devices);
/// The same for a given local rank, as in a launch of several ranks.
std::vector<Device> devices_for_local_rank(const std::string& devices, int local_rank);

/// Ends MPI if this process started it: `clean` calls MPI_Finalize (every rank must reach it);
/// otherwise MPI_Abort ends every rank (one rank failed alone: the others may wait in a
/// collective forever). A no-op without MPI. Call at the end of main.
void shutdown(bool clean);

/// An nn::AmaxReducer over `comm`: gathers the amax rows (registration order, on any devices)
/// into one f32 host buffer, one all_reduce(max), scatters back. Returns nullptr for a group of
/// one (nothing to reduce).
std::shared_ptr<nn::AmaxReducer> make_amax_reducer(std::shared_ptr<Communicator> comm);

}  // namespace octet::dist
