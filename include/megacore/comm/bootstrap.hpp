// Bootstrap: who am I in the job, and the world communicator.
//
// detect_launch_env() reads, in this order, the variables of torchrun-style launchers (torchrun,
// `python -m megacore.launch`: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), of Open MPI's mpirun (OMPI_COMM_WORLD_*) and of Slurm's srun (SLURM_PROCID, ...).
// Without any of them the process is a single rank. init_from_env() turns that into a communicator:
// MPI for host tensors, NCCL for CUDA tensors (its unique id exchanged through MPI under mpirun,
// else through rank 0's TcpStore, see store_config()).
#pragma once

#include <memory>
#include <string>

#include "megacore/comm/communicator.hpp"
#include "megacore/comm/tcp_store.hpp"

namespace megacore::comm {

enum class Launcher { None, Torchrun, OpenMPI, Slurm };
std::string_view launcher_name(Launcher l);

/// This process's place in the job, as the launcher described it.
struct LaunchEnv {
  Launcher launcher = Launcher::None;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;  ///< empty when the launcher did not set MASTER_ADDR
  int master_port = 0;      ///< 0 when unset
};

/// Reads the launch environment; throws ConfigError when it is inconsistent (a rank outside the
/// world, a non-integer value) or when it is a Kubeflow PyTorchJob pod that started one process for
/// several ranks (RANK is then the pod index, not a process rank).
LaunchEnv detect_launch_env();

/// True when this process was started by mpirun/mpiexec (OMPI_COMM_WORLD_SIZE or PMI_SIZE is set).
bool launched_by_mpirun();

/// The GPU of this rank, cuda:(local_rank % visible_gpus). ConfigError when the node's ranks outnumber its GPUs and
/// every rank sees the same GPUs (`cuda_visible_devices` null or empty: no per-rank binding), since NCCL refuses two
/// ranks of one communicator on one GPU; with CUDA_VISIBLE_DEVICES set (a launcher binding GPUs per rank) the
/// mapping is taken as given.
Device rank_gpu(const LaunchEnv& e, int visible_gpus, const char* cuda_visible_devices);

/// Where megacore's rendezvous store (a TcpStore served by rank 0) listens and how the ranks reach it.
struct StoreConfig {
  std::string bind;          ///< the address rank 0 listens on
  std::string connect_host;  ///< the address the other ranks connect to
  int port = 0;
  std::string token;         ///< MEGACORE_STORE_TOKEN, "" when unset
  bool single_node = false;  ///< every rank runs on this node (local world size == world size)
};

/// The store of this launch: on one node it listens on 127.0.0.1 (and ranks connect there), on several
/// on the address of MASTER_ADDR; MEGACORE_STORE_BIND overrides where it listens (ranks then connect to
/// MASTER_ADDR), MEGACORE_STORE_PORT the port. A store that listens beyond loopback needs a token
/// (MEGACORE_STORE_TOKEN, set by megacore.launch and the executors): without one this is a ConfigError
/// that says how to set it, since an open store lets anyone on the network read or plant the NCCL id.
StoreConfig store_config(const LaunchEnv& e);

/// Opens this rank's end of the store: the server on rank 0, holding `preset` before it accepts anyone,
/// a client (connected, token presented) on the others. Blocking steps end within `timeout` with a
/// CommError.
std::unique_ptr<TcpStore> open_store(const LaunchEnv& e, std::chrono::milliseconds timeout,
                                     std::vector<std::pair<std::string, std::string>> preset = {});

/// The world communicator of this job.
/// - device_kind CPU: MPI over MPI_COMM_WORLD (ConfigError naming the fix without MPI or mpirun).
/// - device_kind CUDA: NCCL on device local_rank % cuda_device_count() (the index in device_kind is
///   not used); the unique id goes through MPI when launched by mpirun, else through the store of
///   open_store() at MEGACORE_STORE_PORT if set, else MASTER_PORT + 1 under torchrun (whose own
///   store holds MASTER_PORT), else MASTER_PORT.
std::unique_ptr<Communicator> init_from_env(Device device_kind, const CommOptions& options = {});
/// init_from_env on CUDA when a device is visible, else on the CPU.
std::unique_ptr<Communicator> init_from_env(const CommOptions& options = {});

}  // namespace megacore::comm
