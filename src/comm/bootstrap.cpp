#include "megacore/comm/bootstrap.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/comm/nccl_communicator.hpp"
#include "megacore/comm/tcp_store.hpp"

namespace megacore::comm {
namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

int parse_int(const char* name, const std::string& v, std::string_view who) {
  int out = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  MC_CHECK_AS(ConfigError, ec == std::errc() && p == v.data() + v.size() && !v.empty(),
              "{}='{}' (set by {}) is not an integer", name, v, who);
  return out;
}

int need_int(const char* name, std::string_view who) {
  auto v = env(name);
  MC_CHECK_AS(ConfigError, v.has_value(), "{} is not set, but other variables of {} are; set it as well", name, who);
  return parse_int(name, *v, who);
}

int opt_int(const char* name, std::string_view who, int fallback) {
  auto v = env(name);
  return v ? parse_int(name, *v, who) : fallback;
}

// Slurm writes tasks per node as "4" or "4(x2),3"; the first count is this node's for even layouts.
int slurm_tasks_per_node(int fallback) {
  auto v = env("SLURM_NTASKS_PER_NODE");
  if (!v) v = env("SLURM_TASKS_PER_NODE");
  if (!v) return fallback;
  int out = 0;
  auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), out);
  return ec == std::errc() ? out : fallback;
}

void read_master(LaunchEnv& e, std::string_view who) {
  if (auto a = env("MASTER_ADDR")) e.master_addr = *a;
  if (env("MASTER_PORT")) {
    e.master_port = need_int("MASTER_PORT", who);
    MC_CHECK_AS(ConfigError, e.master_port > 0 && e.master_port <= 65535, "MASTER_PORT={} is not a TCP port (1..65535)",
                e.master_port);
  }
}

// The port of megacore's own rendezvous store (see init_from_env's doc comment).
int store_port(const LaunchEnv& e) {
  if (env("MEGACORE_STORE_PORT")) {
    int p = need_int("MEGACORE_STORE_PORT", "the user");
    MC_CHECK_AS(ConfigError, p > 0 && p <= 65535, "MEGACORE_STORE_PORT={} is not a TCP port (1..65535)", p);
    return p;
  }
  bool torchelastic = env("TORCHELASTIC_RUN_ID").has_value() || env("TORCHELASTIC_USE_AGENT_STORE").has_value();
  if (torchelastic) {
    MC_CHECK_AS(ConfigError, e.master_port < 65535, "MASTER_PORT=65535 leaves no port for megacore's store; set "
                "MEGACORE_STORE_PORT");
    return e.master_port + 1;
  }
  return e.master_port;
}

// True when every address `host` names is a loopback address, i.e. only this machine can reach it.
bool is_loopback(const std::string& host) {
  if (host == "localhost") return true;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (host.empty() || ::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return false;
  bool all = res != nullptr;
  for (addrinfo* a = res; a; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      all &= (ntohl(reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr.s_addr) >> 24) == 127;
    } else if (a->ai_family == AF_INET6) {
      const in6_addr& v6 = reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr;
      all &= IN6_IS_ADDR_LOOPBACK(&v6) ||
             (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
    } else {
      all = false;
    }
  }
  ::freeaddrinfo(res);
  return all;
}

}  // namespace

StoreConfig store_config(const LaunchEnv& e) {
  StoreConfig c;
  c.port = store_port(e);
  c.token = env("MEGACORE_STORE_TOKEN").value_or("");
  MC_CHECK_AS(ConfigError, c.token.size() <= 256, "MEGACORE_STORE_TOKEN has {} characters; use at most 256 (e.g. 64 "
              "hex digits)", c.token.size());
  c.single_node = e.local_world_size == e.world_size;
  auto bind = env("MEGACORE_STORE_BIND");
  if (bind) {
    MC_CHECK_AS(ConfigError, !bind->empty(), "MEGACORE_STORE_BIND is set but empty; set it to an address of rank 0's "
                "host (127.0.0.1, 0.0.0.0, an interface's IP) or unset it");
    c.bind = *bind;
    c.connect_host = e.master_addr;
  } else if (c.single_node) {
    // Every rank is here, so nothing beyond this machine needs to reach the store.
    c.bind = "127.0.0.1";
    c.connect_host = "127.0.0.1";
  } else {
    c.bind = e.master_addr;
    c.connect_host = e.master_addr;
  }
  if (c.token.empty() && !is_loopback(c.bind)) {
    raise<ConfigError>(
        "megacore's rendezvous store would listen on '{}' ({}), reachable from other machines, without a token; "
        "anyone there could read or replace the NCCL id. Export the same secret on every node, e.g. `export "
        "MEGACORE_STORE_TOKEN=$(openssl rand -hex 32)` in the job script before torchrun/srun, or start the ranks with "
        "python -m megacore.launch or a megacore executor (they set one)",
        c.bind, bind ? "MEGACORE_STORE_BIND" : "MASTER_ADDR of a job on several nodes");
  }
  return c;
}

std::unique_ptr<TcpStore> open_store(const LaunchEnv& e, std::chrono::milliseconds timeout,
                                     std::vector<std::pair<std::string, std::string>> preset) {
  StoreConfig c = store_config(e);
  TcpStoreOptions o;
  o.token = c.token;
  o.timeout = timeout;
  o.preset = std::move(preset);
  if (e.rank == 0) {
    // A hostname that resolves to loopback on rank 0 (Debian's 127.0.1.1 entry) is reachable only from
    // here; say so, since the other nodes' ranks will fail at their connect timeout. Not an error: a
    // "multi-node" job simulated on one machine uses 127.0.0.1 on purpose.
    if (!c.single_node && !env("MEGACORE_STORE_BIND") && is_loopback(c.bind)) {
      fmt::print(stderr, "megacore: MASTER_ADDR '{}' is a loopback address on rank 0, so ranks on other nodes cannot "
                 "reach its rendezvous store; set MASTER_ADDR to rank 0's IP, or MEGACORE_STORE_BIND\n", c.bind);
    }
    return std::make_unique<TcpStore>(c.bind, c.port, true, o);
  }
  MC_CHECK_AS(ConfigError, !c.connect_host.empty(), "rank {} cannot reach megacore's rendezvous store: MASTER_ADDR is "
              "not set; export it (rank 0's host) on every rank", e.rank);
  return std::make_unique<TcpStore>(c.connect_host, c.port, false, o);
}

Device rank_gpu(const LaunchEnv& e, int visible_gpus, const char* cuda_visible_devices) {
  MC_CHECK_AS(ConfigError, visible_gpus > 0, "init_from_env(cuda): no CUDA device is visible to rank {} (check "
              "CUDA_VISIBLE_DEVICES), or use the CPU (MPI)", e.rank);
  const bool bound = cuda_visible_devices != nullptr && *cuda_visible_devices != '\0';
  MC_CHECK_AS(ConfigError, bound || e.local_world_size <= visible_gpus,
              "{} ranks on this node (local world size, from the {}) but {} GPU{} visible to each: GPU ranks need one "
              "GPU each (NCCL refuses two ranks of one communicator on one GPU); start at most {} rank{} per node "
              "(--nproc-per-node {} for torchrun or megacore.launch), or CPU ranks through mpirun",
              e.local_world_size, launcher_name(e.launcher), visible_gpus, visible_gpus == 1 ? " is" : "s are",
              visible_gpus, visible_gpus == 1 ? "" : "s", visible_gpus);
  return Device::cuda(e.local_rank % visible_gpus);
}

std::string_view launcher_name(Launcher l) {
  switch (l) {
    case Launcher::None: return "none";
    case Launcher::Torchrun: return "torchrun-style launcher";
    case Launcher::OpenMPI: return "Open MPI";
    case Launcher::Slurm: return "Slurm";
  }
  return "?";
}

bool launched_by_mpirun() {
  return env("OMPI_COMM_WORLD_SIZE").has_value() || env("PMI_SIZE").has_value() || env("PMIX_RANK").has_value();
}

LaunchEnv detect_launch_env() {
  LaunchEnv e;
  if (env("RANK") || env("WORLD_SIZE")) {
    constexpr std::string_view who = "a torchrun-style launcher (RANK/WORLD_SIZE)";
    // A Kubeflow PyTorchJob pod gets RANK = pod index and PET_NPROC_PER_NODE = processes to start;
    // torchrun (or megacore.launch) inside the pod turns those into process ranks and always sets
    // LOCAL_RANK. Without it, this process would claim a rank that belongs to a whole pod.
    auto nproc = env("PET_NPROC_PER_NODE");
    bool started_by_launcher = env("LOCAL_RANK") || env("TORCHELASTIC_RUN_ID");
    if (nproc && *nproc != "1" && !started_by_launcher) {
      raise<ConfigError>(
          "this looks like a Kubeflow PyTorchJob pod (PET_NPROC_PER_NODE={}, RANK={} is the pod index, not a "
          "process rank): start the ranks inside the pod with `torchrun --nproc-per-node {} ...` or `python -m "
          "megacore.launch --nproc-per-node {} ...` instead of running the script directly",
          *nproc, env("RANK").value_or("?"), *nproc, *nproc);
    }
    e.launcher = Launcher::Torchrun;
    e.rank = need_int("RANK", who);
    e.world_size = need_int("WORLD_SIZE", who);
    e.local_rank = opt_int("LOCAL_RANK", who, 0);
    e.local_world_size = opt_int("LOCAL_WORLD_SIZE", who, e.local_rank + 1);
    read_master(e, who);
  } else if (env("OMPI_COMM_WORLD_RANK") || env("OMPI_COMM_WORLD_SIZE")) {
    constexpr std::string_view who = "Open MPI's mpirun";
    e.launcher = Launcher::OpenMPI;
    e.rank = need_int("OMPI_COMM_WORLD_RANK", who);
    e.world_size = need_int("OMPI_COMM_WORLD_SIZE", who);
    e.local_rank = opt_int("OMPI_COMM_WORLD_LOCAL_RANK", who, 0);
    e.local_world_size = opt_int("OMPI_COMM_WORLD_LOCAL_SIZE", who, e.local_rank + 1);
    read_master(e, who);
  } else if (env("SLURM_PROCID") && (env("SLURM_STEP_ID") || env("SLURM_STEPID"))) {
    // Only inside an srun step: a batch script itself also sees SLURM_PROCID=0 and the job's task
    // count, but it is one process.
    constexpr std::string_view who = "Slurm's srun";
    e.launcher = Launcher::Slurm;
    e.rank = need_int("SLURM_PROCID", who);
    e.world_size = need_int("SLURM_NTASKS", who);
    e.local_rank = opt_int("SLURM_LOCALID", who, 0);
    e.local_world_size = slurm_tasks_per_node(e.local_rank + 1);
    read_master(e, who);
  }
  std::string_view who = launcher_name(e.launcher);
  MC_CHECK_AS(ConfigError, e.world_size >= 1, "world size {} (from the {}) must be at least 1", e.world_size, who);
  MC_CHECK_AS(ConfigError, e.rank >= 0 && e.rank < e.world_size, "rank {} (from the {}) is outside the world [0, {})",
              e.rank, who, e.world_size);
  MC_CHECK_AS(ConfigError, e.local_world_size >= 1 && e.local_world_size <= e.world_size,
              "local world size {} (from the {}) must be in [1, world size {}]", e.local_world_size, who, e.world_size);
  MC_CHECK_AS(ConfigError, e.local_rank >= 0 && e.local_rank < e.local_world_size,
              "local rank {} (from the {}) is outside the node's [0, {})", e.local_rank, who, e.local_world_size);
  return e;
}

std::unique_ptr<Communicator> init_from_env(Device device_kind, const CommOptions& options) {
  LaunchEnv e = detect_launch_env();
  if (device_kind.is_cpu()) {
    MC_CHECK_AS(ConfigError, mpi_available(),
                "init_from_env(cpu) needs MPI, but this megacore was built without it; install Open MPI "
                "(libopenmpi-dev) and rebuild, or use CUDA devices (NCCL)");
    if (e.world_size > 1 && !launched_by_mpirun()) {
      raise<ConfigError>("init_from_env(cpu) uses MPI for host tensors, but these {} ranks were started by the {}, "
                         "not mpirun; start them with `mpirun -np {} ...` (srun needs --mpi=pmix), or use CUDA "
                         "devices (NCCL)",
                         e.world_size, launcher_name(e.launcher), e.world_size);
    }
    auto c = make_mpi_world(options);
    MC_CHECK_AS(ConfigError, c->size() == e.world_size && c->rank() == e.rank,
                "MPI sees rank {} of {} but the {} says rank {} of {}; do not mix launchers' variables",
                c->rank(), c->size(), launcher_name(e.launcher), e.rank, e.world_size);
    return c;
  }

  MC_CHECK_AS(ConfigError, nccl_available(),
              "init_from_env(cuda) needs NCCL, but this megacore was built without it; install NCCL and rebuild");
  Device dev = rank_gpu(e, cuda_device_count(), std::getenv("CUDA_VISIBLE_DEVICES"));
  if (e.world_size == 1) return make_nccl_communicator(0, 1, nccl_unique_id(), dev, options);

  if (launched_by_mpirun() && mpi_available()) {
    CommOptions bo;
    bo.timeout = options.timeout;
    bo.name = options.name + "/bootstrap";
    auto w = make_mpi_world(bo);
    MC_CHECK_AS(ConfigError, w->size() == e.world_size && w->rank() == e.rank,
                "MPI sees rank {} of {} but the {} says rank {} of {}; do not mix launchers' variables", w->rank(),
                w->size(), launcher_name(e.launcher), e.rank, e.world_size);
    return make_nccl_communicator_over(*w, dev, options);  // the id made on rank 0, broadcast over MPI
  }

  MC_CHECK_AS(ConfigError, !e.master_addr.empty() && e.master_port > 0,
              "init_from_env(cuda): {} ranks started by the {} need MASTER_ADDR and MASTER_PORT (rank 0's host and a "
              "free port) to exchange the NCCL id; export them, or start the ranks with mpirun",
              e.world_size, launcher_name(e.launcher));
  NcclUniqueId id{};
  // Rank 0's store holds the id before it accepts anyone, and keys cannot be replaced, so no other
  // process can plant its own id for the ranks to read. A fresh store serves each init_from_env call.
  const std::string key = "megacore/nccl_unique_id/" + options.name;
  std::vector<std::pair<std::string, std::string>> preset;
  if (e.rank == 0) {
    id = nccl_unique_id();
    preset.emplace_back(key, std::string(reinterpret_cast<const char*>(id.data()), id.size()));
  }
  auto store = open_store(e, options.timeout, std::move(preset));
  if (e.rank != 0) {
    std::string v = store->get(key);
    MC_CHECK_AS(CommError, v.size() == id.size(), "the NCCL id from the TCP store has {} bytes, expected {}",
                v.size(), id.size());
    std::memcpy(id.data(), v.data(), id.size());
  }
  // NCCL init completes only once every rank has joined, i.e. has read the id, so rank 0's store
  // may close when this returns.
  return make_nccl_communicator(e.rank, e.world_size, id, dev, options);
}

std::unique_ptr<Communicator> init_from_env(const CommOptions& options) {
  return init_from_env(cuda_available() ? Device::cuda() : Device::cpu(), options);
}

std::unique_ptr<Communicator> make_nccl_communicator_over(Communicator& bootstrap, Device device,
                                                          const CommOptions& options) {
  NcclUniqueId u{};
  if (bootstrap.rank() == 0) u = nccl_unique_id();
  if (bootstrap.size() > 1) {
    Tensor id = Tensor::zeros({int64_t(u.size())}, DType::U8);
    std::memcpy(id.data_ptr(), u.data(), u.size());
    if (!bootstrap.device().is_cpu()) id = id.to(bootstrap.device());
    bootstrap.broadcast(id, 0)->wait();
    const Tensor host = id.to(Device::cpu());
    std::memcpy(u.data(), host.data_ptr(), u.size());
  }
  return make_nccl_communicator(bootstrap.rank(), bootstrap.size(), u, device, options);
}

}  // namespace megacore::comm
