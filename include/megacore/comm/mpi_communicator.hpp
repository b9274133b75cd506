// The MPI backend of Communicator: collectives on host (CPU) tensors, built on nonblocking MPI calls
// so every wait can time out. Available when megacore was built with MPI (MEGACORE_WITH_MPI);
// otherwise the factories throw ConfigError.
//
// A communicator works on its own duplicate of the MPI communicator it is made from, so its traffic
// never matches the caller's own MPI calls. Not thread-safe: use one communicator from one thread.
#pragma once

#include <cstddef>
#include <memory>

#include "megacore/comm/communicator.hpp"

namespace megacore::comm {

/// True when this build contains the MPI backend.
bool mpi_available();

/// A communicator over all MPI processes (MPI_COMM_WORLD). Initialises MPI (thread level
/// MPI_THREAD_MULTIPLE if the library offers it) when the caller has not, and then finalises it at
/// process exit. Collective over MPI_COMM_WORLD.
std::unique_ptr<Communicator> make_mpi_world(const CommOptions& options = {});

/// MPI communicators this process still holds for megacore communicators it has destroyed: those waiting
/// for the other members of their group to destroy theirs too (then they are freed), and those kept for
/// the life of the process because the group was aborted (a peer's late abort notice must never reach a
/// freed MPI communicator, whose context id a newer one may reuse). Diagnostics and tests; 0 without MPI.
size_t mpi_retained_communicators();

/// A communicator over an existing MPI communicator, given as the address of an MPI_Comm handle
/// (`&comm` in C/C++, `MPI._addressof(comm)` in mpi4py). MPI must be initialised. Collective over it.
std::unique_ptr<Communicator> make_mpi_communicator(const void* mpi_comm, const CommOptions& options = {});

}  // namespace megacore::comm
