// What every build has: the single-process group, the launcher's world size, and the amax
// reducer over any Communicator. The MPI communicator is src/dist/mpi.cc.
#include "octet/dist/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

namespace octet::dist {

ShardRange shard_range(int64_t total, int size, int rank) {
  OCTET_CHECK(size >= 1 && rank >= 0 && rank < size && total >= 0, "shard_range: rank ", rank,
              " of ", size, " over ", total, " elements");
  const int64_t part = (total + size - 1) / size;
  return {std::min(total, part * rank), std::min(total, part * (rank + 1))};
}

int64_t flat_count(std::span<const Tensor> tensors, const char* what, std::optional<DType> dtype) {
  int64_t total = 0;
  for (const Tensor& t : tensors) {
    if (!dtype) dtype = t.dtype();
    OCTET_CHECK(t.dtype() == *dtype, what, " takes tensors of one dtype (", dtype_name(*dtype),
                "), got ", t.describe());
    total += t.numel();
  }
  return total;
}

void Communicator::start_sum(const Tensor& flat) {
  all_reduce(std::span(&flat, 1), ReduceOp::sum);
}

void SingleProcess::all_reduce(std::span<const Tensor> tensors, ReduceOp op) {
  const DType dtype = tensors.empty() ? DType::f32 : tensors[0].dtype();
  OCTET_CHECK(dtype == DType::f32 || (dtype == DType::bf16 && op == ReduceOp::sum),
              "all_reduce takes f32 tensors (or bf16 for a sum), got ", tensors[0].describe());
  flat_count(tensors, "all_reduce", dtype);
}

void SingleProcess::reduce_scatter(std::span<const Tensor> tensors) {
  flat_count(tensors, "reduce_scatter", DType::f32);
}

void SingleProcess::all_gather(std::span<const Tensor> tensors) {
  flat_count(tensors, "all_gather");
}

void SingleProcess::broadcast(std::span<const Tensor> tensors, int root) {
  OCTET_CHECK(root == 0, "broadcast root ", root, " is not a rank of a single process");
}

int launcher_world_size() {
  // Open MPI's mpirun, then the PMI launchers (MPICH's hydra, Slurm's srun).
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const char* value = std::getenv(name)) {
      const int size = std::atoi(value);
      if (size > 0) return size;
    }
  }
  return 1;
}

namespace {

/// Gathers the amax rows into one host buffer, reduces it once, scatters it back (FIELD-NOTES
/// 2, cause C: one all-reduce over every device's rows, in registration order).
class CommunicatorAmaxReducer final : public nn::AmaxReducer {
 public:
  explicit CommunicatorAmaxReducer(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {}

  void all_reduce_max(std::span<const Tensor> amax_rows) override {
    int64_t total = 0;
    for (const Tensor& row : amax_rows) {
      OCTET_CHECK(row.dtype() == DType::f32, "amax rows are f32, got ", row.describe());
      total += row.numel();
    }
    if (total == 0) return;
    // A host buffer: rows may sit on several devices, and the MPI communicator reduces host
    // memory. (An NCCL group would gather on the rows' device instead.)
    if (flat_.numel() != total) flat_ = Tensor::empty({total}, DType::f32, Device::cpu());
    int64_t at = 0;
    for (const Tensor& row : amax_rows) {
      flat_.slice(at, at + row.numel()).copy_from(row.view({-1}));
      at += row.numel();
    }
    comm_->all_reduce(std::span(&flat_, 1), ReduceOp::max);
    at = 0;
    for (const Tensor& row : amax_rows) {
      row.view({-1}).copy_from(flat_.slice(at, at + row.numel()));
      at += row.numel();
    }
  }

 private:
  std::shared_ptr<Communicator> comm_;
  Tensor flat_;  ///< reused while the pending rows keep their total size
};

}  // namespace

std::shared_ptr<nn::AmaxReducer> make_amax_reducer(std::shared_ptr<Communicator> comm) {
  OCTET_CHECK(comm != nullptr, "make_amax_reducer: no communicator");
  if (comm->size() == 1) return nullptr;
  return std::make_shared<CommunicatorAmaxReducer>(std::move(comm));
}

}  // namespace octet::dist
