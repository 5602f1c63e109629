// How the ranks of a launch find each other without MPI: the torchrun convention (RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and a TCP socket on the master through which
// rank 0 hands every other rank the NCCL communicator's 128-byte unique id. Plain POSIX sockets:
// built and tested without a GPU.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <optional>
#include <string>

namespace octet::dist {

/// The bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
inline constexpr size_t kUniqueIdBytes = 128;
using UniqueIdBytes = std::array<char, kUniqueIdBytes>;

/// How long rank 0 waits for every rank to fetch the id, and a rank for rank 0 to listen: the
/// ranks of one launch start within seconds, a node of a multi-node launch within minutes.
inline constexpr std::chrono::seconds kBootstrapDeadline{300};

/// A launch by torchrun (or anything setting its variables).
struct TorchrunEnvironment {
  int rank = 0, world_size = 1, local_rank = 0;
  std::string master_addr;
  int master_port = 0;
};
/// The torchrun variables when WORLD_SIZE is set; nullopt otherwise. Throws naming the variable
/// when one is missing or malformed (a rank outside the world, a port outside 1..65535).
std::optional<TorchrunEnvironment> torchrun_environment();

/// This process's rank on its node: LOCAL_RANK (torchrun), OMPI_COMM_WORLD_LOCAL_RANK (Open
/// MPI), MPI_LOCALRANKID (MPICH), SLURM_LOCALID; 0 when none is set. It picks the GPU.
int launcher_local_rank();

/// Rank 0's end: a listening socket that hands out the id.
class UniqueIdServer {
 public:
  /// Listens on `port` on every interface; 0 picks a free port (port() says which).
  explicit UniqueIdServer(int port);
  ~UniqueIdServer();
  UniqueIdServer(const UniqueIdServer&) = delete;
  UniqueIdServer& operator=(const UniqueIdServer&) = delete;
  int port() const { return port_; }
  /// Sends `id` to `clients` connections; throws when they have not all come within `deadline`.
  void serve(const UniqueIdBytes& id, int clients, std::chrono::milliseconds deadline);

 private:
  int socket_ = -1;
  int port_ = 0;
};

/// Another rank's end: connects to `host`:`port` (retrying while rank 0 is not listening yet)
/// and reads the id; throws when that does not succeed within `deadline`.
UniqueIdBytes fetch_unique_id(const std::string& host, int port,
                              std::chrono::milliseconds deadline);

}  // namespace octet::dist
