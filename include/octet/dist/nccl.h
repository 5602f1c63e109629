// The NCCL communicator: GPU ranks, one communicator per process on its device, every collective
// on octet's stream for that device (octet::cuda::stream). Built with OCTET_WITH_NCCL.
#pragma once

#include <functional>
#include <memory>

#include "octet/core/device.h"
#include "octet/dist/bootstrap.h"
#include "octet/dist/communicator.h"

namespace octet::dist {

/// True when this build has the NCCL communicator (OCTET_WITH_NCCL).
bool built_with_nccl();

/// Makes rank 0's unique id every rank's: called with rank 0's id filled in on rank 0, returns
/// with it on every rank (an MPI broadcast, or the TCP socket of bootstrap.h).
using ShareUniqueId = std::function<void(UniqueIdBytes& id)>;

/// Rank `rank` of an NCCL communicator of `size` ranks on `device` (a CUDA device). Collectives
/// take tensors on `device` or on the CPU (staged through the device), and return with the
/// result in place: the host waits for each one, polling NCCL's asynchronous error and the
/// collective deadline (watchdog.h); on an error or the deadline the communicator is aborted
/// (ncclCommAbort) and the call throws. Throws without NCCL.
std::shared_ptr<Communicator> make_nccl_communicator(const Device& device, int rank, int size,
                                                     const ShareUniqueId& share_id);

}  // namespace octet::dist
