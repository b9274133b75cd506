// Failing fast: one rank's unrecoverable error ends the whole job instead of leaving its peers waiting in
// a collective until the timeout (DESIGN.md, "Errors reach every rank").
#pragma once

namespace megacore::comm {

/// Ends this process at once with exit code `code` after an unrecoverable error on this rank. When MPI is
/// initialised this is MPI_Abort(MPI_COMM_WORLD, code): mpirun (or srun) then ends every rank of the job.
/// Otherwise (NCCL ranks started by megacore.launch, torchrun or srun) the process exits without running
/// destructors (an NCCL communicator's orderly teardown would wait for the peers) and the launcher stops
/// the others. Abort the communicators you hold first (Communicator::abort) where that matters.
[[noreturn]] void abort_job(int code);

}  // namespace megacore::comm
