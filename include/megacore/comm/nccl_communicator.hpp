// The NCCL backend of Communicator: collectives on CUDA tensors, enqueued on the caller's stream.
// Available when megacore was built with NCCL (MEGACORE_WITH_NCCL); otherwise the factories throw
// ConfigError.
//
// Initialisation is always non-blocking and polled with ncclCommGetAsyncError under CommOptions::timeout;
// the operations then run on a blocking communicator split off it (CommOptions::nccl_blocking, the
// default: a few µs per call; false keeps every enqueue non-blocking and polled). A Work waits on a CUDA
// event while polling for asynchronous errors, and the watchdog follows every operation, so a hang or a
// dead peer ends in ncclCommAbort and a CommError naming the group, the operation, the ranks and the
// elapsed time.
// The usual NCCL_* environment variables (NCCL_DEBUG, NCCL_ALGO, NCCL_PROTO, NCCL_BUFFSIZE,
// NCCL_SOCKET_IFNAME, NCCL_IB_*, ...) are read by NCCL itself and passed through untouched.
// Not thread-safe: use one communicator from one thread.
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "megacore/comm/communicator.hpp"

namespace megacore::comm {

/// The bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
using NcclUniqueId = std::array<uint8_t, 128>;

/// True when this build contains the NCCL backend.
bool nccl_available();
/// NCCL version of the linked library as major*10000 + minor*100 + patch (0 without NCCL).
int nccl_version();
/// A fresh unique id (ncclGetUniqueId); made on one rank and handed to all others out of band.
NcclUniqueId nccl_unique_id();

/// A communicator of `size` ranks on CUDA device `device`; this process is `rank`. Collective: every
/// rank calls it with the same id and size within options.timeout. World ranks are 0..size-1.
std::unique_ptr<Communicator> make_nccl_communicator(int rank, int size, const NcclUniqueId& id, Device device,
                                                     const CommOptions& options = {});

/// An NCCL communicator over the ranks of `bootstrap` (same rank numbers) on CUDA device `device`: the
/// unique id is made on bootstrap's rank 0 and broadcast through it (any backend; typically the MPI world).
/// Collective over `bootstrap`.
std::unique_ptr<Communicator> make_nccl_communicator_over(Communicator& bootstrap, Device device,
                                                          const CommOptions& options = {});

}  // namespace megacore::comm
