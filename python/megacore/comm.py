"""Collectives and bootstrap: ``megacore.comm.init_from_env()`` gives the world communicator.

Works unchanged under ``mpirun``, Slurm ``srun``, torchrun-style environments and
``python -m megacore.launch``. NCCL carries CUDA tensors, MPI carries host tensors. Every operation has a
timeout; a hang, an NCCL error or a dead peer becomes ``megacore.CommError`` naming the group, the
operation, the ranks and the elapsed time. Synchronous calls on GPUs are stream-ordered (the current stream
waits, the host does not, as in torch.distributed); a collective that then never completes is aborted by
the NCCL watchdog, and ``check_health()`` (also run by ``megacore.synchronize()``) raises its CommError.
"""

from ._C import comm as _c

Communicator = _c.Communicator
abort_job = _c.abort_job
Work = _c.Work
check_health = _c.check_health
detect_launch_env = _c.detect_launch_env
flight_record = _c.flight_record
init_from_env = _c.init_from_env
mpi_available = _c.mpi_available
nccl_available = _c.nccl_available
nccl_version = _c.nccl_version

__all__ = ["Communicator", "Work", "abort_job", "check_health", "detect_launch_env", "flight_record", "init_from_env",
           "mpi_available", "nccl_available", "nccl_version"]
