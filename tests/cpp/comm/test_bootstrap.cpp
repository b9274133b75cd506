// Launch-environment parsing and the TCP store, in one process.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <thread>

#include "comm/clean_env.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::comm;
using namespace std::chrono_literals;

namespace {

using mctest::CleanEnv;

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A port nothing listens on (bound once by the kernel's choice, then released).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace

TEST_CASE("launch env: nothing set is a single process", "[comm]") {
  CleanEnv env;
  LaunchEnv e = detect_launch_env();
  CHECK(e.launcher == Launcher::None);
  CHECK(e.rank == 0);
  CHECK(e.world_size == 1);
  CHECK(e.local_rank == 0);
  CHECK(e.local_world_size == 1);
  CHECK(e.master_addr.empty());
  CHECK(e.master_port == 0);
  CHECK_FALSE(launched_by_mpirun());
}

TEST_CASE("launch env: torchrun-style variables", "[comm]") {
  CleanEnv env;
  env.set("RANK", "5");
  env.set("WORLD_SIZE", "8");
  env.set("LOCAL_RANK", "1");
  env.set("LOCAL_WORLD_SIZE", "4");
  env.set("MASTER_ADDR", "node-0.cluster");
  env.set("MASTER_PORT", "29500");
  // torchrun wins over the other launchers' variables.
  env.set("OMPI_COMM_WORLD_RANK", "0");
  env.set("OMPI_COMM_WORLD_SIZE", "1");
  LaunchEnv e = detect_launch_env();
  CHECK(e.launcher == Launcher::Torchrun);
  CHECK(e.rank == 5);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 4);
  CHECK(e.master_addr == "node-0.cluster");
  CHECK(e.master_port == 29500);

  SECTION("one process per pod (no LOCAL_RANK)") {
    ::unsetenv("LOCAL_RANK");
    ::unsetenv("LOCAL_WORLD_SIZE");
    env.set("PET_NPROC_PER_NODE", "1");
    LaunchEnv p = detect_launch_env();
    CHECK(p.rank == 5);
    CHECK(p.local_rank == 0);
    CHECK(p.local_world_size == 1);
  }
  SECTION("bad values are ConfigErrors that name the variable") {
    env.set("RANK", "8");
    CHECK_THROWS_AS(detect_launch_env(), ConfigError);
    CHECK(error_of(detect_launch_env).find("rank 8") != std::string::npos);
    env.set("RANK", "x1");
    CHECK(error_of(detect_launch_env).find("RANK='x1'") != std::string::npos);
    env.set("RANK", "1 ");
    CHECK_THROWS_AS(detect_launch_env(), ConfigError);
    env.set("RANK", "-1");
    CHECK_THROWS_AS(detect_launch_env(), ConfigError);
    env.set("RANK", "1");
    env.set("LOCAL_RANK", "4");
    CHECK_THROWS_AS(detect_launch_env(), ConfigError);
    env.set("LOCAL_RANK", "1");
    env.set("MASTER_PORT", "70000");
    CHECK_THROWS_AS(detect_launch_env(), ConfigError);
    env.set("MASTER_PORT", "29500");
    ::unsetenv("WORLD_SIZE");
    CHECK(error_of(detect_launch_env).find("WORLD_SIZE is not set") != std::string::npos);
  }
}

TEST_CASE("launch env: Kubeflow PyTorchJob pod run without a launcher is refused", "[comm]") {
  CleanEnv env;
  env.set("RANK", "1");  // the pod index
  env.set("WORLD_SIZE", "2");
  env.set("MASTER_ADDR", "job-master-0");
  env.set("MASTER_PORT", "23456");
  env.set("PET_NPROC_PER_NODE", "4");
  env.set("PET_NNODES", "2");
  env.set("PET_NODE_RANK", "1");
  CHECK_THROWS_AS(detect_launch_env(), ConfigError);
  std::string msg = error_of(detect_launch_env);
  CHECK(msg.find("Kubeflow") != std::string::npos);
  CHECK(msg.find("torchrun --nproc-per-node 4") != std::string::npos);
  CHECK(msg.find("python -m megacore.launch") != std::string::npos);

  SECTION("torchrun inside the pod sets LOCAL_RANK and process ranks") {
    env.set("RANK", "6");
    env.set("WORLD_SIZE", "8");
    env.set("LOCAL_RANK", "2");
    env.set("LOCAL_WORLD_SIZE", "4");
    LaunchEnv e = detect_launch_env();
    CHECK(e.rank == 6);
    CHECK(e.local_rank == 2);
  }
}

TEST_CASE("launch env: Open MPI and Slurm", "[comm]") {
  CleanEnv env;
  SECTION("mpirun") {
    env.set("OMPI_COMM_WORLD_RANK", "3");
    env.set("OMPI_COMM_WORLD_SIZE", "4");
    env.set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
    env.set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
    LaunchEnv e = detect_launch_env();
    CHECK(e.launcher == Launcher::OpenMPI);
    CHECK((e.rank == 3 && e.world_size == 4 && e.local_rank == 1 && e.local_world_size == 2));
    CHECK(launched_by_mpirun());
    env.set("OMPI_COMM_WORLD_RANK", "4");
    CHECK_THROWS_AS(detect_launch_env(), ConfigError);
  }
  SECTION("srun") {
    env.set("SLURM_PROCID", "9");
    env.set("SLURM_NTASKS", "16");
    env.set("SLURM_LOCALID", "1");
    env.set("SLURM_TASKS_PER_NODE", "8(x2)");
    env.set("SLURM_STEP_ID", "0");
    LaunchEnv e = detect_launch_env();
    CHECK(e.launcher == Launcher::Slurm);
    CHECK((e.rank == 9 && e.world_size == 16 && e.local_rank == 1 && e.local_world_size == 8));
    env.set("SLURM_NTASKS_PER_NODE", "4");
    CHECK(detect_launch_env().local_world_size == 4);
    env.set("SLURM_NTASKS", "abc");
    CHECK(error_of(detect_launch_env).find("SLURM_NTASKS='abc'") != std::string::npos);
  }
  SECTION("a batch script outside srun is one process") {
    env.set("SLURM_PROCID", "0");
    env.set("SLURM_NTASKS", "16");
    CHECK(detect_launch_env().launcher == Launcher::None);
  }
}

TEST_CASE("init_from_env refuses what cannot work", "[comm]") {
  CleanEnv env;
  env.set("RANK", "1");
  env.set("WORLD_SIZE", "2");
  env.set("LOCAL_RANK", "1");
  env.set("LOCAL_WORLD_SIZE", "2");
  // Host tensors go through MPI, which these ranks were not started by.
  CHECK_THROWS_AS(init_from_env(Device::cpu()), ConfigError);
  std::string msg = error_of([] { init_from_env(Device::cpu()); });
  CHECK(msg.find(mpi_available() ? "mpirun" : "built without it") != std::string::npos);
  // CUDA: without a GPU, no device; with one, no MASTER_ADDR/PORT for the id exchange.
  CHECK_THROWS_AS(init_from_env(Device::cuda()), ConfigError);
}

TEST_CASE("rank_gpu: ranks outnumbering the GPUs they all see are refused", "[comm]") {
  LaunchEnv e;
  e.launcher = Launcher::Torchrun;
  e.world_size = e.local_world_size = 4;
  e.rank = e.local_rank = 3;
  CHECK(rank_gpu(e, 4, nullptr) == Device::cuda(3));
  CHECK(rank_gpu(e, 8, "") == Device::cuda(3));
  // Four ranks, one GPU, no per-rank binding: every rank would take cuda:0.
  CHECK_THROWS_AS(rank_gpu(e, 1, nullptr), ConfigError);
  const std::string msg = error_of([&] { rank_gpu(e, 2, ""); });
  CHECK(msg.find("4 ranks on this node") != std::string::npos);
  CHECK(msg.find("2 GPUs are visible") != std::string::npos);
  CHECK(msg.find("--nproc-per-node 2") != std::string::npos);
  // A launcher that binds GPUs per rank (CUDA_VISIBLE_DEVICES set): each rank's own GPU is its cuda:0.
  CHECK(rank_gpu(e, 1, "GPU-3") == Device::cuda(0));
  CHECK(rank_gpu(e, 2, "4,5") == Device::cuda(1));
  CHECK_THROWS_AS(rank_gpu(e, 0, nullptr), ConfigError);
}

TEST_CASE("tcp store: set, get, wait across clients", "[comm][store]") {
  TcpStore server("127.0.0.1", 0, /*is_server=*/true, 10s);
  REQUIRE(server.is_server());
  const int port = server.port();
  REQUIRE(port > 0);
  server.set("id", std::string("\0\1\2binary", 9));
  constexpr int kClients = 4;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kClients), seen(kClients);
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      try {
        TcpStore c(i % 2 ? "localhost" : "127.0.0.1", port, false, 10s);
        seen[i] = c.get("id");
        c.set("rank/" + std::to_string(i), std::to_string(i * i));
        std::vector<std::string> keys;
        for (int j = 0; j < kClients; ++j) keys.push_back("rank/" + std::to_string(j));
        c.wait(keys);  // every client's key, set by the others at their own pace
        std::string v;
        if (!c.try_get("rank/" + std::to_string((i + 1) % kClients), v) || v != std::to_string((i + 1) % kClients * ((i + 1) % kClients)))
          errors[i] = "wrong value " + v;
        if (c.try_get("missing", v)) errors[i] = "missing key found";
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    CHECK(errors[i] == "");
    CHECK(seen[i] == std::string("\0\1\2binary", 9));
  }
  CHECK(server.get("rank/3") == "9");
}

TEST_CASE("tcp store: a client waits for a server that starts late", "[comm][store]") {
  int port = free_port();
  std::string got, error;
  std::thread client([&] {
    try {
      TcpStore c("127.0.0.1", port, false, 20s);
      got = c.get("late");
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(300ms);
  {
    TcpStore server("127.0.0.1", port, true, 20s);
    std::this_thread::sleep_for(200ms);
    server.set("late", "value");
    client.join();  // the server must outlive the client's get
  }
  CHECK(error == "");
  CHECK(got == "value");
}

TEST_CASE("tcp store: timeouts and refused connections are CommErrors", "[comm][store]") {
  TcpStore server("127.0.0.1", 0, true, 10s);
  TcpStore client("127.0.0.1", server.port(), false, 300ms);
  auto start = std::chrono::steady_clock::now();
  std::string msg = error_of([&] { client.get("never-set"); });
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(msg.find("key 'never-set' was not set within") != std::string::npos);
  CHECK(elapsed < 5.0);
  CHECK_THROWS_AS(client.get("never-set"), CommError);
  CHECK_THROWS_AS(client.wait({"never-set"}, 100ms), CommError);

  int port = free_port();
  msg = error_of([&] { TcpStore c("127.0.0.1", port, false, 300ms); });
  CHECK(msg.find("could not connect") != std::string::npos);
  CHECK_THROWS_AS(TcpStore("127.0.0.1", port, false, 200ms), CommError);

  // The port of a running server cannot be served twice.
  CHECK_THROWS_AS(TcpStore("127.0.0.1", server.port(), true, 1s), CommError);
  CHECK_THROWS_AS(TcpStore("127.0.0.1", 0, false, 1s), ValueError);
}
