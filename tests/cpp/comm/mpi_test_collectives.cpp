// MPI communicator on host tensors, run under mpirun -np 2/4/8. Every check runs on every rank;
// tests never let one rank skip a collective except where that is the point (the timeout test).
#include <mpi.h>

#include <thread>

#include "comm/comm_suite.hpp"
#include "megacore/comm/mpi_communicator.hpp"

using namespace commtest;
using namespace std::chrono_literals;

namespace {

CommOptions opts(std::string name = "world", bool check_shapes = false) {
  CommOptions o;
  o.name = std::move(name);
  o.timeout = 60s;  // generous for 8 oversubscribed ranks on 2 cores; a desync still ends, not hangs
  o.check_shapes = check_shapes;
  return o;
}

}  // namespace

TEST_CASE("mpi world basics", "[comm]") {
  auto w = make_mpi_world(opts());
  REQUIRE(w->backend() == Backend::MPI);
  REQUIRE(w->size() >= 1);
  std::vector<int> ids(size_t(w->size()));
  for (int i = 0; i < w->size(); ++i) ids[i] = i;
  CHECK(w->world_ranks() == ids);
  CHECK(w->name() == "world");
  CHECK_FALSE(w->aborted());
  w->barrier();
  Tensor t = make(DType::F32, {1.0});
  WorkPtr work = w->all_reduce(t);
  work->wait();
  CHECK(work->is_completed());
  work->wait();  // a second wait is a no-op
  CHECK(t.item() == double(w->size()));
}

TEST_CASE("mpi all_reduce, every dtype and op", "[comm]") {
  auto w = make_mpi_world(opts());
  check_all_reduce(*w, Device::cpu(), {});
}

TEST_CASE("mpi broadcast, all_gather, reduce_scatter", "[comm]") {
  auto w = make_mpi_world(opts());
  check_broadcast(*w, Device::cpu(), {});
  check_all_gather(*w, Device::cpu(), {});
  check_reduce_scatter(*w, Device::cpu(), {});
}

TEST_CASE("mpi all_to_all even and uneven", "[comm]") {
  auto w = make_mpi_world(opts());
  check_all_to_all(*w, Device::cpu(), {});
}

TEST_CASE("mpi batch_send_recv ring", "[comm]") {
  auto w = make_mpi_world(opts());
  check_ring_send_recv(*w, Device::cpu(), {});
}

TEST_CASE("mpi split into sub-groups", "[comm]") {
  auto w = make_mpi_world(opts());
  check_split(*w, Device::cpu(), {}, opts());
  // Groups of groups: world ranks are those of the original world, not of the parent.
  auto half = w->split(w->rank() < (w->size() + 1) / 2 ? 0 : 1, w->rank(), opts("half"));
  auto pairs = half->split(half->rank() / 2, half->rank(), opts("pair"));
  for (size_t i = 0; i < pairs->world_ranks().size(); ++i) {
    CHECK(pairs->world_ranks()[i] == half->world_ranks()[half->rank() / 2 * 2 + i]);
  }
}

TEST_CASE("mpi several operations in flight", "[comm]") {
  auto w = make_mpi_world(opts());
  std::vector<Tensor> ts;
  std::vector<WorkPtr> works;
  for (int i = 0; i < 8; ++i) {
    ts.push_back(make(DType::I64, {double(i), double(w->rank())}));
    works.push_back(w->all_reduce(ts.back(), ReduceOp::Max));
  }
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();  // any completion order
  for (int i = 0; i < 8; ++i) CHECK(ts[i].to_double_vector() == std::vector<double>{double(i), w->size() - 1.0});
}

TEST_CASE("mpi rejects bad arguments before starting", "[comm]") {
  auto w = make_mpi_world(opts());
  const int n = w->size();
  Tensor m = Tensor::zeros({3, 4});
  Tensor nc = m.transpose(0, 1);
  CHECK_THROWS_AS(w->all_reduce(nc), ValueError);
  Tensor undefined;
  CHECK_THROWS_AS(w->all_reduce(undefined), ValueError);
  Tensor in = Tensor::zeros({5});
  Tensor bad_out = Tensor::zeros({5 * n + 1});
  CHECK_THROWS_AS(w->all_gather(in, bad_out), ValueError);
  Tensor i32_out = Tensor::zeros({5 * n}, DType::I32);
  CHECK_THROWS_AS(w->all_gather(in, i32_out), ValueError);
  Tensor rs_out = Tensor::zeros({2});
  CHECK_THROWS_AS(w->reduce_scatter(in, rs_out), ValueError);
  CHECK_THROWS_AS(w->broadcast(in, n), ValueError);
  CHECK_THROWS_AS(w->broadcast(in, -1), ValueError);
  Tensor a2a_in = Tensor::zeros({2 * n}), a2a_out = Tensor::zeros({2 * n});
  CHECK_THROWS_AS(w->all_to_all(a2a_in, a2a_out, std::vector<int64_t>(size_t(n), 1), {}), ValueError);
  CHECK_THROWS_AS(w->all_to_all(a2a_in, a2a_out, std::vector<int64_t>(size_t(n + 1), 2), {}), ValueError);
  if (n > 1) {
    Tensor odd = Tensor::zeros({2 * n + 1});
    CHECK_THROWS_AS(w->all_to_all(odd, a2a_out), ValueError);
  }
  std::vector<P2POp> bad_peer{{P2POp::Send, in, n}};
  CHECK_THROWS_AS(w->batch_send_recv(bad_peer), ValueError);
  try {
    w->all_reduce(nc);
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()).find("contiguous") != std::string::npos);
  }
  // Nothing was posted: the communicator is still in step on every rank.
  Tensor one = make(DType::F32, {1.0});
  w->all_reduce(one)->wait();
  CHECK(one.item() == double(n));
}

TEST_CASE("mpi check_shapes turns mismatches into CommError on every rank", "[comm]") {
  auto w = make_mpi_world(opts("checked", /*check_shapes=*/true));
  check_check_shapes(*w, Device::cpu(), {});
}

TEST_CASE("mpi timeout: a rank that skips a collective", "[comm]") {
  auto w = make_mpi_world(opts());
  if (w->size() < 2) return;
  // The collective that times out runs on its own group, so the world stays in step for the rest.
  CommOptions o = opts("tmo");
  o.timeout = 1500ms;
  auto c = w->split(0, w->rank(), o);
  const int me = w->rank();
  if (me != 1) {
    Tensor t = make(DType::F32, {1.0, 2.0});
    auto start = std::chrono::steady_clock::now();
    try {
      c->all_reduce(t)->wait();
      FAIL("all_reduce with a missing rank did not throw");
    } catch (const CommError& e) {
      std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find("group 'tmo'") != std::string::npos);
      CHECK(msg.find("all_reduce(sum) f32 x2") != std::string::npos);
      // Either this rank timed out itself, or a peer that did told it first.
      CHECK((msg.find("timed out after") != std::string::npos));
    }
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(elapsed < 1.5 + 5.0);
    CHECK(c->aborted());
    Tensor u = make(DType::F32, {1.0});
    CHECK_THROWS_AS(c->all_reduce(u), CommError);  // aborted for good
  }
  w->barrier();
  if (me == 1) {
    // The skipped rank is told by its peers' abort notices; it must not post into the dead group,
    // where its op would match the stale one.
    auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!c->aborted() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    CHECK(c->aborted());
    Tensor u = make(DType::F32, {1.0});
    try {
      c->all_reduce(u)->wait();
      FAIL("all_reduce on a group aborted by its peers did not throw");
    } catch (const CommError& e) {
      CHECK(std::string(e.what()).find("aborted") != std::string::npos);
    }
  }
  c.reset();
  // The world is unaffected.
  Tensor one = make(DType::I32, {1.0});
  w->all_reduce(one)->wait();
  CHECK(one.item() == double(w->size()));
}

TEST_CASE("mpi abort() reaches every rank of the group", "[comm]") {
  auto w = make_mpi_world(opts());
  auto c = w->split(0, w->rank(), opts("doomed"));
  if (c->rank() == 0) c->abort();
  w->barrier();
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!c->aborted() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  CHECK(c->aborted());
  Tensor t = make(DType::F32, {1.0});
  CHECK_THROWS_AS(c->all_reduce(t), CommError);
  CHECK_THROWS_AS(c->barrier(), CommError);
}

// Waits (up to 20 s) until the retained count is at most `limit`; returns the last count.
size_t retained_settles_to(size_t limit) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  size_t n = mpi_retained_communicators();
  while (n > limit && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
    n = mpi_retained_communicators();
  }
  return n;
}

TEST_CASE("mpi groups made and destroyed over and over are freed once every member lets go", "[comm]") {
  auto w = make_mpi_world(opts());
  w->barrier();
  const size_t before = mpi_retained_communicators();
  for (int i = 0; i < 40; ++i) {
    // Singletons and pairs: the shapes whose private duplicates pick a context id among few ranks.
    auto one = w->split(w->rank(), 0, opts("one"));
    auto pair = w->split(w->rank() / 2, w->rank(), opts("pair"));
    Tensor t = make(DType::I32, {1.0});
    pair->all_reduce(t)->wait();
    CHECK(t.item() == double(pair->size()));
  }
  // Every rank has destroyed every group; their release barriers complete as the ranks poll.
  w->barrier();
  CHECK(retained_settles_to(before) <= before);
}

TEST_CASE("mpi a group one rank has destroyed while its peers abort it stays allocated there", "[comm]") {
  // The last rank lets go of 'doomed' first; the others then abort it, so their abort notices travel to
  // a communicator the last rank no longer uses. Were its MPI communicators freed, the notices would be
  // delivered to whichever new communicator reuses their context id (Open MPI segfaulted there, in the
  // MPI_Comm_dup of a singleton group's control communicator).
  auto w = make_mpi_world(opts());
  if (w->size() < 2) return;
  const int last = w->size() - 1;
  for (int round = 0; round < 3; ++round) {
    auto doomed = w->split(0, w->rank(), opts("doomed"));
    if (w->rank() == last) doomed.reset();
    w->barrier();
    if (w->rank() != last) {
      doomed->abort();
      CHECK(doomed->aborted());
      doomed.reset();
    }
    w->barrier();
    // 'doomed' of every round so far stays on every rank: aborted here, or waiting for peers that aborted it.
    const size_t held = mpi_retained_communicators();
    CHECK(held >= size_t(round + 1));
    for (int i = 0; i < 10; ++i) {
      // Several singletons at once, so their control duplicates take every context id freed on this rank.
      std::vector<std::unique_ptr<Communicator>> ones;
      for (int k = 0; k < 3; ++k) ones.push_back(w->split(w->rank(), 0, opts("one")));
      auto pair = w->split(w->rank() / 2, w->rank(), opts("pair"));
      for (const auto& one : ones) CHECK_FALSE(one->aborted());
      CHECK_FALSE(pair->aborted());
      Tensor t = make(DType::I32, {double(w->rank())});
      pair->all_reduce(t)->wait();
      const int first = w->rank() / 2 * 2;
      CHECK(t.item() == double(pair->size() == 2 ? 2 * first + 1 : first));
    }
    w->barrier();
    // The fresh groups were freed again; 'doomed' was not.
    CHECK(retained_settles_to(held) <= held);
    CHECK(mpi_retained_communicators() >= size_t(round + 1));
  }
}

TEST_CASE("mpi communicator over a caller's MPI_Comm", "[comm]") {
  // The opaque-handle factory (what the Python bindings use with mpi4py's MPI._addressof).
  MPI_Comm world = MPI_COMM_WORLD;
  auto c = make_mpi_communicator(&world, opts("wrapped"));
  CHECK(c->name() == "wrapped");
  Tensor t = make(DType::I64, {2.0, double(c->rank())});
  c->all_reduce(t, ReduceOp::Avg)->wait();
  // Integer average truncates toward zero: sum(0..n-1) / n = (n - 1) / 2.
  CHECK(t.to_double_vector() == std::vector<double>{2.0, std::trunc((c->size() - 1) / 2.0)});
  CHECK_THROWS_AS(make_mpi_communicator(nullptr, opts()), ValueError);
}
