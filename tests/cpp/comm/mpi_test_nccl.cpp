// NCCL communicator on CUDA tensors, run under mpirun -np 2/4 on a GPU machine:
//   mpirun -np 2 build/tests/megacore_mpi_tests "[gpu]"
// MPI only carries the NCCL unique id. Each rank uses device local_rank % device count.
// Without a GPU every case returns early with a warning (on every rank alike).
#include <thread>

#include "comm/comm_suite.hpp"

using namespace commtest;
using namespace std::chrono_literals;

namespace {

CommOptions nccl_opts(std::string name = "world", bool check_shapes = false) {
  CommOptions o;
  o.name = std::move(name);
  o.timeout = 120s;
  o.check_shapes = check_shapes;
  return o;
}

Device my_device() {
  LaunchEnv e = detect_launch_env();
  return Device::cuda(e.local_rank % cuda_device_count());
}

// The NCCL world, its unique id broadcast over the MPI world.
std::unique_ptr<Communicator> nccl_world(const CommOptions& o) {
  auto mpi = make_mpi_world();
  return make_nccl_communicator_over(*mpi, my_device(), o);
}

}  // namespace

TEST_CASE("nccl collectives, every dtype and op", "[gpu][comm]") {
  MC_REQUIRE_GPU();
  REQUIRE(nccl_available());
  auto w = nccl_world(nccl_opts());
  REQUIRE(w->backend() == Backend::NCCL);
  Device dev = my_device();
  Stream s = Stream::create(dev);
  check_all_reduce(*w, dev, s);
  check_broadcast(*w, dev, s);
  check_all_gather(*w, dev, s);
  check_reduce_scatter(*w, dev, s);
  check_all_to_all(*w, dev, s);
  check_ring_send_recv(*w, dev, s);
  w->barrier();
  // The default (legacy) stream works as well.
  check_all_reduce(*w, dev, {});
}

TEST_CASE("nccl split, check_shapes", "[gpu][comm]") {
  MC_REQUIRE_GPU();
  auto w = nccl_world(nccl_opts());
  Device dev = my_device();
  Stream s = Stream::create(dev);
  check_split(*w, dev, s, nccl_opts());
  auto checked = nccl_world(nccl_opts("checked", /*check_shapes=*/true));
  check_check_shapes(*checked, dev, s);
}

TEST_CASE("nccl rejects host tensors and foreign streams", "[gpu][comm]") {
  MC_REQUIRE_GPU();
  auto w = nccl_world(nccl_opts());
  Tensor host = Tensor::zeros({4});
  CHECK_THROWS_AS(w->all_reduce(host), ValueError);
  if (cuda_device_count() > 1) {
    Device other = Device::cuda((my_device().index + 1) % cuda_device_count());
    Tensor t = Tensor::zeros({4}, DType::F32, my_device());
    CHECK_THROWS_AS(w->all_reduce(t, ReduceOp::Sum, Stream::create(other)), ValueError);
  }
  Tensor one = Tensor::full({1}, 1.0, DType::F32, my_device());
  w->all_reduce(one)->wait();
  CHECK(one.item() == double(w->size()));
}

TEST_CASE("nccl timeout: a rank that skips a collective", "[gpu][comm]") {
  MC_REQUIRE_GPU();
  auto mpi = make_mpi_world();
  if (mpi->size() < 2) return;
  CommOptions o = nccl_opts("tmo");
  o.timeout = 5s;
  auto c = nccl_world(o);
  if (c->rank() != 1) {
    Tensor t = Tensor::full({1024}, 1.0, DType::F32, my_device());
    auto start = std::chrono::steady_clock::now();
    try {
      c->all_reduce(t)->wait();
      FAIL("all_reduce with a missing rank did not throw");
    } catch (const CommError& e) {
      std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find("group 'tmo'") != std::string::npos);
      // Either the host wait times out, or (blocking communicators) the first call on the communicator is
      // stuck inside NCCL setting up its connections and the watchdog aborts it.
      CHECK((msg.find("timed out after") != std::string::npos || msg.find("inside NCCL for") != std::string::npos));
    }
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(elapsed < 5.0 + 15.0);
    CHECK(c->aborted());
  }
  // The skipped rank abandons the group too; ncclCommAbort never waits for peers.
  mpi->barrier();
  c->abort();
  CHECK(c->aborted());
  Tensor u = Tensor::zeros({1}, DType::F32, my_device());
  CHECK_THROWS_AS(c->all_reduce(u), CommError);
}

TEST_CASE("nccl wait_on: stream-ordered waits, and the watchdog ends a skipped collective", "[gpu][comm]") {
  MC_REQUIRE_GPU();
  auto mpi = make_mpi_world();
  CommOptions o = nccl_opts("wd");
  o.timeout = 4s;
  auto c = nccl_world(o);
  const Device dev = my_device();
  Stream side = Stream::create(dev), consumer = Stream::create(dev);
  // Correct results through wait_on alone: the collective runs on `side`, the copy to the host is queued
  // on `consumer` right after wait_on returns (no host wait in between), many times over.
  for (int i = 0; i < 20; ++i) {
    Tensor t = Tensor::full({int64_t(1) << 18}, double(c->rank() + i), DType::F32, dev, side);
    c->all_reduce(t, ReduceOp::Sum, side)->wait_on(consumer);
    std::vector<double> v = t.to(Device::cpu(), consumer).to_double_vector();
    const double want = double(c->size()) * (c->size() - 1) / 2 + double(c->size()) * i;
    REQUIRE(v.front() == want);
    REQUIRE(v.back() == want);
  }
  // wait_on({}) orders the device's legacy default stream (what item() reads on).
  Tensor one = Tensor::full({1}, 1.0, DType::F32, dev, consumer);
  c->all_reduce(one, ReduceOp::Sum, consumer)->wait_on({});
  CHECK(one.item() == double(c->size()));
  if (mpi->size() < 2) return;
  // Rank 1 skips a collective the others only stream-wait: nobody host-waits it, so the watchdog must
  // find the timeout, abort the communicator (which frees the waiting streams), report it through
  // check_health() and make the next operation throw CommError with the reason.
  try {
    check_health();  // drop what earlier cases left unreported
  } catch (const CommError&) {
  }
  c->barrier();
  if (c->rank() != 1) {
    Tensor t = Tensor::full({4096}, 1.0, DType::F32, dev, side);
    const auto start = std::chrono::steady_clock::now();
    c->all_reduce(t, ReduceOp::Sum, side)->wait_on(consumer);
    const double enqueue_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(enqueue_s < 1.0);  // the host did not wait
    consumer.synchronize();  // returns once the abort has stopped the stuck kernel
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(elapsed >= 3.0);
    CHECK(elapsed < 4.0 + 15.0);
    CHECK(c->aborted());
    CHECK_THROWS_AS(check_health(), CommError);
    CHECK_NOTHROW(check_health());  // reported once
    Tensor u = Tensor::zeros({1}, DType::F32, dev);
    try {
      c->all_reduce(u, ReduceOp::Sum, consumer);
      FAIL("an operation on the aborted communicator did not throw");
    } catch (const CommError& e) {
      std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find("group 'wd'") != std::string::npos);
      CHECK(msg.find("found by the watchdog") != std::string::npos);
    }
  }
  mpi->barrier();
  c->abort();
  CHECK(c->aborted());
}
