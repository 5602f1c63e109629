// The NCCL communicator (GPU ranks) and the choice of communicator for a device:
// from_environment(device). Built with OCTET_WITH_NCCL=1; without it a multi-rank CUDA launch is
// refused with one clear error.
#include "octet/dist/nccl.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "octet/dist/watchdog.h"

#if OCTET_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include "dist/cuda/ordered_key_launch.h"
#include "octet/core/cuda_context.h"
#endif

namespace octet::dist {

#if OCTET_WITH_NCCL

bool built_with_nccl() { return true; }

namespace {

static_assert(sizeof(ncclUniqueId) == kUniqueIdBytes, "bootstrap.h's id size is NCCL's");

/// How often the host looks at a collective in flight: NCCL's error state and the stream.
constexpr std::chrono::microseconds kPollInterval{50};

void check(ncclResult_t result, const char* what) {
  if (result != ncclSuccess && result != ncclInProgress)
    OCTET_ERROR(what, " failed: ", ncclGetErrorString(result));
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const Device& device, int rank, int size, const ShareUniqueId& share_id)
      : device_(device), rank_(rank), size_(size), deadline_(collective_deadline()) {
    OCTET_CHECK(device.is_cuda(), "the NCCL communicator runs on a CUDA device, got ", device);
    check_device_available(device);
    DeviceGuard guard(device_);
    stream_ = octet::cuda::stream(device_);
    ncclUniqueId id{};
    if (rank_ == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    UniqueIdBytes bytes;
    std::memcpy(bytes.data(), &id, kUniqueIdBytes);
    share_id(bytes);
    std::memcpy(&id, bytes.data(), kUniqueIdBytes);
    // Non-blocking: every call returns at once, so that a peer that never arrives is seen by
    // the deadline below and the communicator can be aborted instead of hanging in NCCL.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    check(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config), "ncclCommInitRankConfig");
    wait_until_done("ncclCommInitRankConfig", /*stream_work=*/false);
  }

  ~NcclCommunicator() override {
    if (comm_ == nullptr) return;
    DeviceGuard guard(device_);
    if (aborted_) return;
    // Finalize flushes outstanding work; a failure there leaves only abort.
    const ncclResult_t finalized = ncclCommFinalize(comm_);
    if (finalized == ncclSuccess || finalized == ncclInProgress) {
      ncclResult_t state = ncclInProgress;
      const auto until = std::chrono::steady_clock::now() + deadline_;
      while (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress &&
             std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(kPollInterval);
      if (state == ncclSuccess) {
        ncclCommDestroy(comm_);
        return;
      }
    }
    ncclCommAbort(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string describe() const override {
    return "nccl, " + std::to_string(size_) + (size_ == 1 ? " rank" : " ranks") + " on " +
           device_.str();
  }

  void all_reduce(std::span<const Tensor> tensors, ReduceOp op) override {
    const DType dtype = tensors.empty() ? DType::f32 : tensors[0].dtype();
    OCTET_CHECK(dtype == DType::f32 || (dtype == DType::bf16 && op == ReduceOp::sum),
                "all_reduce takes f32 tensors (or bf16 for a sum), got ", tensors[0].describe());
    const int64_t total = flat_count(tensors, "all_reduce", dtype);
    if (total == 0) return;
    DeviceGuard guard(device_);
    order_after_sums();
    void* data = pack(tensors, total, dtype_size(dtype));
    if (op == ReduceOp::max) {
      // An exact, order-free MAX over keys that order like the floats with NaN on top.
      cuda::to_ordered_keys(data, total, stream_);
      run("ncclAllReduce(max)", [&] {
        return ncclAllReduce(data, data, total, ncclUint32, ncclMax, comm_, stream_);
      });
      cuda::from_ordered_keys(data, total, stream_);
    } else {
      sum_to_every_rank(data, total, dtype, stream_);
    }
    unpack(tensors, dtype_size(dtype), 0, total);
    wait_until_done("all_reduce", /*stream_work=*/true);
  }

  void reduce_scatter(std::span<const Tensor> tensors) override {
    const int64_t total = flat_count(tensors, "reduce_scatter", DType::f32);
    if (total == 0) return;
    DeviceGuard guard(device_);
    order_after_sums();
    void* data = pack(tensors, total, sizeof(float));
    // The sum all_reduce computes, so each shard is bitwise all_reduce's (ncclReduceScatter
    // sums each shard in its own ring order).
    sum_to_every_rank(data, total, DType::f32, stream_);
    const ShardRange mine = shard_range(total, size_, rank_);
    unpack(tensors, sizeof(float), mine.begin, mine.end);
    wait_until_done("reduce_scatter", /*stream_work=*/true);
  }

  void all_gather(std::span<const Tensor> tensors) override {
    const int64_t total = flat_count(tensors, "all_gather");
    if (total == 0) return;
    DeviceGuard guard(device_);
    order_after_sums();
    const size_t element = dtype_size(tensors[0].dtype());
    // ncclAllGather takes equal parts: shard_range's ceil(total / size), the buffer padded to
    // size parts, this rank's part already in place (NCCL's in-place form).
    const int64_t part = (total + size_ - 1) / size_;
    char* data = static_cast<char*>(pack(tensors, total, element, part * size_));
    run("ncclAllGather", [&] {
      return ncclAllGather(data + rank_ * part * element, data, part * element, ncclChar, comm_,
                           stream_);
    });
    unpack(tensors, element, 0, total);
    wait_until_done("all_gather", /*stream_work=*/true);
  }

  void broadcast(std::span<const Tensor> tensors, int root) override {
    OCTET_CHECK(root >= 0 && root < size_, "broadcast root ", root, " is not a rank of ", size_);
    int64_t bytes = 0;
    for (const Tensor& t : tensors) bytes += static_cast<int64_t>(t.nbytes());
    if (bytes == 0) return;
    DeviceGuard guard(device_);
    order_after_sums();
    char* data = static_cast<char*>(pack_bytes(tensors, bytes));
    run("ncclBroadcast",
        [&] { return ncclBroadcast(data, data, bytes, ncclChar, root, comm_, stream_); });
    unpack_bytes(tensors);
    wait_until_done("broadcast", /*stream_work=*/true);
  }

  void barrier() override {
    Tensor one = Tensor::zeros({1}, DType::f32, device_);
    all_reduce(std::span(&one, 1), ReduceOp::sum);
  }

  void start_sum(const Tensor& flat) override {
    OCTET_CHECK((flat.dtype() == DType::f32 || flat.dtype() == DType::bf16) &&
                    flat.device() == device_,
                "start_sum takes one f32 or bf16 tensor on ", device_, ", got ", flat.describe());
    if (flat.numel() == 0) return;
    DeviceGuard guard(device_);
    if (side_.stream == nullptr) {
      check_cuda(cudaStreamCreateWithFlags(&side_.stream, cudaStreamNonBlocking));
      check_cuda(cudaEventCreateWithFlags(&side_.queued, cudaEventDisableTiming));
      check_cuda(cudaEventCreateWithFlags(&side_.summed, cudaEventDisableTiming));
    }
    // The sum reads what the device's stream wrote before now and runs beside what it does next.
    check_cuda(cudaEventRecord(side_.queued, stream_));
    check_cuda(cudaStreamWaitEvent(side_.stream, side_.queued, 0));
    sum_to_every_rank(flat.raw_data(), flat.numel(), flat.dtype(), side_.stream);
    sums_pending_ = true;
  }

  void wait_sums() override {
    if (!sums_pending_) return;
    DeviceGuard guard(device_);
    // The host waits as for any collective (NCCL's errors, the deadline): a dead peer aborts the
    // communicator instead of leaving the device's stream waiting for the sums forever.
    wait_until_done("all_reduce", side_.stream);
    order_after_sums();
  }

 private:
  /// The stream and events of the sums that overlap the device's stream (start_sum).
  struct SideStream {
    cudaStream_t stream = nullptr;
    cudaEvent_t queued = nullptr, summed = nullptr;
    ~SideStream() {
      if (summed != nullptr) cudaEventDestroy(summed);
      if (queued != nullptr) cudaEventDestroy(queued);
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
  };

  /// The device's stream waits for the sums started so far. Every collective on it does so
  /// first: this communicator's kernels then run in the order they were issued, the same on
  /// every rank, whatever NCCL does with kernels of one communicator on two streams.
  void order_after_sums() {
    if (!sums_pending_) return;
    sums_pending_ = false;
    check_cuda(cudaEventRecord(side_.summed, side_.stream));
    check_cuda(cudaStreamWaitEvent(stream_, side_.summed, 0));
  }

  /// A sum that leaves every rank the same bits: reduced on rank 0, then broadcast (the same
  /// contract as the MPI communicator's, whatever algorithm NCCL picks for an all-reduce).
  void sum_to_every_rank(void* data, int64_t total, DType dtype, cudaStream_t stream) {
    const ncclDataType_t type = dtype == DType::f32 ? ncclFloat32 : ncclBfloat16;
    run("ncclReduce",
        [&] { return ncclReduce(data, data, total, type, ncclSum, 0, comm_, stream); });
    run("ncclBroadcast",
        [&] { return ncclBroadcast(data, data, total, type, 0, comm_, stream); });
  }

  /// The device buffer of `tensors` as one flat buffer of `capacity` (>= total) elements: the
  /// one tensor itself when it is on the device and needs no padding, else staging_ with every
  /// tensor's bytes copied in on the stream.
  void* pack(std::span<const Tensor> tensors, int64_t total, size_t element,
             int64_t capacity = -1) {
    if (capacity < 0) capacity = total;
    in_place_ = tensors.size() == 1 && tensors[0].device() == device_ && capacity == total;
    if (in_place_) return tensors[0].raw_data();
    order_after_other_gpus(tensors);
    reserve(static_cast<size_t>(capacity) * element);
    size_t at = 0;
    for (const Tensor& t : tensors) {
      check_cuda(cudaMemcpyAsync(staging() + at, t.raw_data(), t.nbytes(), cudaMemcpyDefault,
                                 stream_));
      at += t.nbytes();
    }
    return staging();
  }
  void* pack_bytes(std::span<const Tensor> tensors, int64_t bytes) {
    in_place_ = false;
    order_after_other_gpus(tensors);
    reserve(static_cast<size_t>(bytes));
    size_t at = 0;
    for (const Tensor& t : tensors) {
      check_cuda(cudaMemcpyAsync(staging() + at, t.raw_data(), t.nbytes(), cudaMemcpyDefault,
                                 stream_));
      at += t.nbytes();
    }
    return staging();
  }

  /// Tensors may also lie on the CPU or on another GPU of this process (a model split over GPUs):
  /// the staging copies are peer copies on this communicator's stream, which first waits for
  /// the work each other GPU's stream has queued (the tensors' producers). The copies back need
  /// no such order: every collective that unpacks waits for its stream on the host before it
  /// returns.
  void order_after_other_gpus(std::span<const Tensor> tensors) {
    std::vector<int> waited;
    for (const Tensor& t : tensors) {
      const Device d = t.device();
      if (!d.is_cuda() || d == device_ ||
          std::find(waited.begin(), waited.end(), d.index) != waited.end())
        continue;
      waited.push_back(d.index);
      const cudaEvent_t queued = octet::cuda::record_event(d);
      check_cuda(cudaStreamWaitEvent(stream_, queued, 0));
      check_cuda(cudaEventDestroy(queued));
    }
  }

  /// Copies elements [begin, end) of the staging buffer back into `tensors`, on the stream.
  void unpack(std::span<const Tensor> tensors, size_t element, int64_t begin, int64_t end) {
    if (in_place_) return;
    int64_t at = 0;
    for (const Tensor& t : tensors) {
      const int64_t from = std::max(begin, at), to = std::min(end, at + t.numel());
      if (from < to)
        check_cuda(cudaMemcpyAsync(static_cast<char*>(t.raw_data()) + (from - at) * element,
                                   staging() + from * element, (to - from) * element,
                                   cudaMemcpyDefault, stream_));
      at += t.numel();
    }
  }
  void unpack_bytes(std::span<const Tensor> tensors) {
    size_t at = 0;
    for (const Tensor& t : tensors) {
      check_cuda(cudaMemcpyAsync(t.raw_data(), staging() + at, t.nbytes(), cudaMemcpyDefault,
                                 stream_));
      at += t.nbytes();
    }
  }

  void reserve(size_t bytes) {
    if (staging_.defined() && staging_.nbytes() >= bytes) return;
    // i32 words: octet's tensors have no byte dtype; the collectives count bytes themselves.
    staging_ = Tensor::empty({static_cast<int64_t>((bytes + 3) / 4)}, DType::i32, device_);
  }
  char* staging() const { return static_cast<char*>(staging_.raw_data()); }

  /// Enqueues one NCCL call. A non-blocking communicator may answer ncclInProgress: the next
  /// call waits until the enqueue (not the work) is done, under the deadline.
  template <typename Call>
  void run(const char* what, Call&& call) {
    const ncclResult_t result = call();
    if (result == ncclInProgress) wait_until_done(what, cudaStream_t{nullptr});
    else if (result != ncclSuccess) fail(what, result);
  }

  void wait_until_done(const char* what, bool stream_work) {
    wait_until_done(what, stream_work ? stream_ : nullptr);
  }
  /// Waits until NCCL has no call in progress and `stream` (unless null) is idle, polling NCCL's
  /// asynchronous error; aborts the communicator and throws on an error or when the collective
  /// deadline passes (a peer died or hangs).
  void wait_until_done(const char* what, cudaStream_t stream) {
    const auto start = std::chrono::steady_clock::now();
    while (true) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t asked = ncclCommGetAsyncError(comm_, &state);
      if (asked != ncclSuccess) fail(what, asked);
      if (state != ncclSuccess && state != ncclInProgress) fail(what, state);
      if (state == ncclSuccess) {
        if (stream == nullptr) return;
        const cudaError_t queried = cudaStreamQuery(stream);
        if (queried == cudaSuccess) return;
        if (queried != cudaErrorNotReady) check_cuda(queried);
      }
      if (std::chrono::steady_clock::now() - start > deadline_) {
        abort();
        OCTET_ERROR("rank ", rank_, " of ", size_, " (nccl on ", device_, "): ", what,
                    " did not complete within ", deadline_.count() / 1000,
                    " s: another rank died or hangs; the communicator was aborted (",
                    kCollectiveTimeoutVariable, " sets the deadline)");
      }
      std::this_thread::sleep_for(kPollInterval);
    }
  }

  [[noreturn]] void fail(const char* what, ncclResult_t result) {
    const std::string reason = ncclGetErrorString(result);
    const char* detail = ncclGetLastError(comm_);
    abort();
    OCTET_ERROR("rank ", rank_, " of ", size_, " (nccl on ", device_, "): ", what, " failed: ",
                reason, detail && *detail ? std::string(" (") + detail + ")" : std::string(),
                "; the communicator was aborted");
  }

  void abort() {
    if (!aborted_ && comm_ != nullptr) ncclCommAbort(comm_);
    aborted_ = true;
  }

  void check_cuda(cudaError_t result) {
    if (result == cudaSuccess) return;
    abort();
    OCTET_ERROR("the NCCL communicator on ", device_, ": ", cudaGetErrorString(result));
  }

  Device device_;
  int rank_ = 0, size_ = 1;
  std::chrono::milliseconds deadline_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
  bool in_place_ = false;  ///< the last pack() used the tensor itself
  Tensor staging_;         ///< the flat buffer of collectives over several or host tensors
  SideStream side_;
  bool sums_pending_ = false;  ///< start_sum queued work on side_ that stream_ has not waited for
};

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(const Device& device, int rank, int size,
                                                     const ShareUniqueId& share_id) {
  return std::make_shared<NcclCommunicator>(device, rank, size, share_id);
}

#else  // OCTET_WITH_NCCL

bool built_with_nccl() { return false; }

std::shared_ptr<Communicator> make_nccl_communicator(const Device& device, int, int size,
                                                     const ShareUniqueId&) {
  OCTET_ERROR("a ", size, "-rank run on ", device,
              " needs the NCCL communicator, but this octet was built without NCCL "
              "(OCTET_WITH_NCCL=OFF: no nccl.h and libnccl were found): install NCCL and rebuild, "
              "or train on one GPU");
}

#endif  // OCTET_WITH_NCCL

std::shared_ptr<Communicator> from_environment(const Device& device) {
  const std::optional<TorchrunEnvironment> torchrun = torchrun_environment();
  if (!device.is_cuda()) {
    OCTET_CHECK(!torchrun || torchrun->world_size == 1 || launcher_world_size() > 1,
                "launched as ", torchrun ? torchrun->world_size : 1,
                " ranks by torchrun's variables (WORLD_SIZE) on the CPU: CPU ranks reduce over "
                "MPI, so launch them with mpirun; torchrun's launch serves GPU (NCCL) ranks");
    return from_environment();
  }
  if (launcher_world_size() > 1) {
    std::shared_ptr<Communicator> mpi = from_environment();
    if (mpi->size() == 1) return mpi;
    return make_nccl_communicator(device, mpi->rank(), mpi->size(), [&](UniqueIdBytes& id) {
      Tensor bytes = Tensor::empty({static_cast<int64_t>(kUniqueIdBytes / 4)}, DType::i32);
      std::memcpy(bytes.raw_data(), id.data(), kUniqueIdBytes);
      mpi->broadcast(std::span(&bytes, 1), 0);
      std::memcpy(id.data(), bytes.raw_data(), kUniqueIdBytes);
    });
  }
  if (torchrun && torchrun->world_size > 1) {
    const TorchrunEnvironment env = *torchrun;
    return make_nccl_communicator(device, env.rank, env.world_size, [&](UniqueIdBytes& id) {
      if (env.rank == 0) {
        UniqueIdServer server(env.master_port);
        server.serve(id, env.world_size - 1, kBootstrapDeadline);
      } else {
        id = fetch_unique_id(env.master_addr, env.master_port, kBootstrapDeadline);
      }
    });
  }
  return std::make_shared<SingleProcess>();
}

std::vector<Device> devices_for_local_rank(const std::string& devices, int local_rank) {
  // "cuda" names no GPU: each rank of a launch takes the one of its local rank.
  if (devices == "cuda") return {Device::cuda(local_rank)};
  std::vector<Device> stages = Device::parse_list(devices);
  if (stages.size() < 2) return stages;
  // A split: the list is local rank 0's; rank r's GPUs follow the previous ranks' in order.
  int span = 0;
  for (const Device& d : stages)
    if (d.is_cuda()) span = std::max(span, d.index + 1);
  for (Device& d : stages)
    if (d.is_cuda()) d = Device::cuda(d.index + local_rank * span);
  return stages;
}

std::vector<Device> devices_for_this_rank(const std::string& devices) {
  const bool several = launcher_world_size() > 1 ||
                       (torchrun_environment() && torchrun_environment()->world_size > 1);
  return several ? devices_for_local_rank(devices, launcher_local_rank())
                 : Device::parse_list(devices);
}

}  // namespace octet::dist
