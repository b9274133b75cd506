// NCCL communicator on CUDA tensors, run under mpirun -np 2/4 on a GPU machine:
//   mpirun -np 2 build/tests/megacore_mpi_tests "[gpu]"
// MPI only carries the NCCL unique id. Each rank uses device local_rank % device count.
// Without a GPU every case returns early with a warning (on every rank alike).
#include <random>
#include <thread>

#include "comm/comm_suite.hpp"
#include "megacore/build_config.hpp"
#if MEGACORE_WITH_NCCL
#include <cuda_runtime.h>
#endif

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

// A random salt drawn by rank 0 and broadcast, so every run checks fresh values and every rank the same.
uint64_t fresh_salt() {
  auto mpi = make_mpi_world();
  Tensor salt_t = Tensor::from_vector(std::vector<int64_t>{int64_t(std::random_device{}() & 0xffffff)}, {1});
  mpi->broadcast(salt_t, 0)->wait();
  return uint64_t(salt_t.item());
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

// CommOptions::copy_engine: the all-gathers and sum reduce-scatters move by copy engines through IPC-mapped
// staging slots. A small staging buffer makes every collective above a few KiB per rank run in chunks, so
// the slots are reused many times within one call; inputs are fresh each run (rank 0's salt), the
// all-gathers must be exact and the reduce-scatters within one rounding of the float64 sum (they add in
// f32 and round once). Ops the path does not take (Avg, all-reduce) interleave on the same group.
TEST_CASE("nccl copy-engine all-gather and reduce-scatter", "[gpu][comm][copy_engine]") {
  MC_REQUIRE_GPU();
  uint64_t salt = fresh_salt();
  INFO("salt " << salt);
  CommOptions o = nccl_opts("ce");
  o.copy_engine = true;
  o.copy_engine_buffer_bytes = size_t(64) << 10;  // chunks of 16 KiB per rank at 2 ranks, 8 KiB at 4
  auto c = nccl_world(o);
  const Device dev = my_device();
  Stream s = Stream::create(dev), consumer = Stream::create(dev);
  const int n_ranks = c->size(), me = c->rank();
  for (int iter = 0; iter < 2; ++iter) {
    for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::I32}) {
      for (int64_t n : {int64_t(1), int64_t(5), int64_t(1003), int64_t(4099), int64_t(40000)}) {
        ++salt;
        const Stream& st = (n % 2) ? s : Stream{};  // a created stream and the legacy default stream
        Tensor in = make_on(dt, values(dt, n, me, salt), dev);
        Tensor out = Tensor::zeros({n * n_ranks}, dt, dev);
        s.wait(Stream::default_stream(dev));  // the tensors were made on the legacy default stream
        c->all_gather(in, out, st)->wait();
        std::vector<double> want;
        for (int r = 0; r < n_ranks; ++r) {
          auto v = values(dt, n, r, salt);
          want.insert(want.end(), v.begin(), v.end());
        }
        INFO("all_gather " << dtype_name(dt) << " n " << n);
        CHECK(out.to_double_vector() == want);
        if (n_ranks > 1) CHECK(c->copy_engine_active());
        if (!is_floating(dt)) continue;
        auto all = all_values(dt, n * n_ranks, n_ranks, salt + 7777);
        Tensor rin = make_on(dt, all[size_t(me)], dev);
        Tensor rout = Tensor::zeros({n}, dt, dev);
        s.wait(Stream::default_stream(dev));
        // Stream-ordered: the result is read on another stream after wait_on, with no host wait between.
        c->reduce_scatter(rin, rout, ReduceOp::Sum, st)->wait_on(consumer);
        std::vector<double> got = rout.to(Device::cpu(), consumer).to_double_vector(), rw, scale;
        reference_reduce(dt, ReduceOp::Sum, all, rw, scale);
        auto b = rw.begin() + std::ptrdiff_t(n * me);
        auto sb = scale.begin() + std::ptrdiff_t(n * me);
        expect_close(got, std::vector<double>(b, b + n), std::vector<double>(sb, sb + n), dt, 1,
                     "copy-engine reduce_scatter n " + std::to_string(n));
        // Avg is not the copy engines' (NCCL's kernels run it) and lines up with them on the same group.
        Tensor aout = Tensor::zeros({n}, dt, dev);
        s.wait(Stream::default_stream(dev));
        c->reduce_scatter(rin, aout, ReduceOp::Avg, st)->wait();
        reference_reduce(dt, ReduceOp::Avg, all, rw, scale);
        expect_close(aout.to_double_vector(), std::vector<double>(rw.begin() + std::ptrdiff_t(n * me),
                                                                  rw.begin() + std::ptrdiff_t(n * (me + 1))),
                     std::vector<double>(sb, sb + n), dt, n_ranks, "reduce_scatter Avg n " + std::to_string(n));
      }
    }
    check_all_reduce(*c, dev, s);
  }
  // A group whose copy engines are off stays on NCCL.
  auto plain = nccl_world(nccl_opts("plain"));
  Tensor in = Tensor::full({64}, double(me), DType::F32, dev);
  Tensor out = Tensor::zeros({64 * n_ranks}, DType::F32, dev);
  plain->all_gather(in, out)->wait();
  CHECK_FALSE(plain->copy_engine_active());
  CHECK(out.to_double_vector().back() == double(n_ranks - 1));
}

TEST_CASE("nccl copy-engine collectives: a rank that skips one ends in CommError, no stream stays stuck",
          "[gpu][comm][copy_engine]") {
  MC_REQUIRE_GPU();
  auto mpi = make_mpi_world();
  if (mpi->size() < 2) return;
  try {
    check_health();  // drop what earlier cases left unreported
  } catch (const CommError&) {
  }
  CommOptions o = nccl_opts("ce_wd");
  o.copy_engine = true;
  o.timeout = 4s;
  auto c = nccl_world(o);
  const Device dev = my_device();
  Stream side = Stream::create(dev), consumer = Stream::create(dev);
  Tensor in = Tensor::full({4096}, double(c->rank()), DType::F32, dev);
  Tensor out = Tensor::zeros({4096 * int64_t(c->size())}, DType::F32, dev);
  c->all_gather(in, out, side)->wait();  // sets the copy engines up (collective)
  REQUIRE(c->copy_engine_active());
  c->barrier();
  if (c->rank() != 1) {
    // Rank 1 never posts this all-gather: the stream waits for its flag until the watchdog aborts the
    // group, whose abort releases the flags; the host never waited.
    const auto start = std::chrono::steady_clock::now();
    c->all_gather(in, out, side)->wait_on(consumer);
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 1.0);
    consumer.synchronize();
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(elapsed >= 3.0);
    CHECK(elapsed < 4.0 + 15.0);
    CHECK(c->aborted());
    CHECK_THROWS_AS(check_health(), CommError);
    CHECK_THROWS_AS(c->all_gather(in, out, side), CommError);
  }
  mpi->barrier();
  c->abort();
  CHECK(c->aborted());
}

// CommOptions::copy_engine, send/receive batches: the receiver's copy engine reads each send straight from
// the sender's tensor (CUDA IPC, addresses through the host mailbox; comm/nccl/peer_copy.hpp). Three patterns
// per round, each against values regenerated locally (exact: nothing is summed): the CP ring (two tensors to
// rank + 1, two from rank − 1, as layers::SelfAttention's ring passes them), every pair of ranks including a
// rank to itself with a byte count that differs per (sender, receiver) pair and empty transfers, and two
// batches in a row to the same peer before anyone waits (they pair in issue order). Tensors come from the
// caching allocator, whose freed blocks are reused, so later batches read allocations already mapped. Fresh values
// each run (rank 0's salt); results are read on another stream after wait_on, with no host wait. A small
// staging buffer makes the collectives interleaved on the group run in chunks.
TEST_CASE("nccl copy-engine send/receive batches", "[gpu][comm][copy_engine]") {
  MC_REQUIRE_GPU();
  uint64_t salt = fresh_salt();
  INFO("salt " << salt);
  CommOptions o = nccl_opts("ce_p2p");
  o.copy_engine = true;
  o.copy_engine_buffer_bytes = size_t(128) << 10;
  auto c = nccl_world(o);
  const int n = c->size(), me = c->rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  if (n > 1) REQUIRE(c->copy_engine_active());
  const Device dev = my_device();
  Stream s = Stream::create(dev), consumer = Stream::create(dev);
  // Elements rank `from` sends rank `to` in pattern 2: 0 for one pair in three, otherwise 1 to ~40k.
  auto pair_count = [&](int from, int to) -> int64_t {
    const uint64_t h = (salt * 31 + uint64_t(from) * 7 + uint64_t(to) * 13) % 3;
    return h == 0 ? 0 : int64_t(1 + (salt + uint64_t(from) * 977 + uint64_t(to) * 4051) % 40000);
  };
  auto tag = [&](int from, int to, uint64_t k) { return salt * 131 + uint64_t(from * 17 + to) * 7 + k; };
  for (int round = 0; round < 3; ++round) {
    for (DType dt : {DType::BF16, DType::F32, DType::I64}) {
      ++salt;
      INFO("round " << round << " dtype " << dtype_name(dt));
      // 1. The ring: two tensors of different sizes to rank + 1 while rank − 1's arrive.
      const int64_t na = 20000 + int64_t(salt % 997), nb = 3 + int64_t(salt % 13);
      Tensor x = make_on(dt, values(dt, na, me, tag(me, next, 1)), dev);
      Tensor y = make_on(dt, values(dt, nb, me, tag(me, next, 2)), dev);
      Tensor rx = Tensor::zeros({na}, dt, dev), ry = Tensor::zeros({nb}, dt, dev);
      const Stream& st = round % 2 ? Stream{} : s;  // a created stream and the legacy default stream
      s.wait(Stream::default_stream(dev));           // the tensors were made on the legacy default stream
      c->batch_send_recv({{P2POp::Send, x, next}, {P2POp::Send, y, next}, {P2POp::Recv, rx, prev},
                          {P2POp::Recv, ry, prev}},
                         st)
          ->wait_on(consumer);
      CHECK(rx.to(Device::cpu(), consumer).to_double_vector() == values(dt, na, prev, tag(prev, me, 1)));
      CHECK(ry.to(Device::cpu(), consumer).to_double_vector() == values(dt, nb, prev, tag(prev, me, 2)));
      // 2. Every pair, this rank to itself as well, uneven and empty transfers.
      std::vector<P2POp> ops;
      std::vector<Tensor> recv(static_cast<size_t>(n));
      for (int p = 0; p < n; ++p) {
        ops.push_back({P2POp::Send, make_on(dt, values(dt, pair_count(me, p), me, tag(me, p, 3)), dev), p});
        recv[size_t(p)] = Tensor::zeros({pair_count(p, me)}, dt, dev);
        ops.push_back({P2POp::Recv, recv[size_t(p)], p});
      }
      s.wait(Stream::default_stream(dev));
      c->batch_send_recv(ops, s)->wait_on(consumer);
      for (int p = 0; p < n; ++p) {
        INFO("from rank " << p << ", " << pair_count(p, me) << " elements");
        CHECK(recv[size_t(p)].to(Device::cpu(), consumer).to_double_vector() ==
              values(dt, pair_count(p, me), p, tag(p, me, 3)));
      }
      // 3. Two batches to the same peer before any wait: their chunks pair in issue order.
      Tensor a1 = make_on(dt, values(dt, 9000, me, tag(me, next, 4)), dev);
      Tensor a2 = make_on(dt, values(dt, 7000, me, tag(me, next, 5)), dev);
      Tensor r1 = Tensor::zeros({9000}, dt, dev), r2 = Tensor::zeros({7000}, dt, dev);
      s.wait(Stream::default_stream(dev));
      WorkPtr w1 = c->batch_send_recv({{P2POp::Send, a1, next}, {P2POp::Recv, r1, prev}}, s);
      WorkPtr w2 = c->batch_send_recv({{P2POp::Send, a2, next}, {P2POp::Recv, r2, prev}}, s);
      w1->wait_on(consumer);
      w2->wait_on(consumer);
      CHECK(r1.to(Device::cpu(), consumer).to_double_vector() == values(dt, 9000, prev, tag(prev, me, 4)));
      CHECK(r2.to(Device::cpu(), consumer).to_double_vector() == values(dt, 7000, prev, tag(prev, me, 5)));
    }
    // A collective and NCCL's own ops interleave with the batches on the same group.
    check_all_reduce(*c, dev, s);
    check_all_gather(*c, dev, s);
  }
}

TEST_CASE("nccl copy-engine send/receive: a rank that skips a batch ends in CommError, no stream stays stuck",
          "[gpu][comm][copy_engine]") {
  MC_REQUIRE_GPU();
  auto mpi = make_mpi_world();
  if (mpi->size() < 2) return;
  try {
    check_health();  // drop what earlier cases left unreported
  } catch (const CommError&) {
  }
  CommOptions o = nccl_opts("ce_p2p_wd");
  o.copy_engine = true;
  o.timeout = 4s;
  auto c = nccl_world(o);
  REQUIRE(c->copy_engine_active());
  const Device dev = my_device();
  Stream side = Stream::create(dev), consumer = Stream::create(dev);
  const int n = c->size(), me = c->rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  Tensor x = Tensor::full({1 << 20}, double(me), DType::F32, dev), rx = Tensor::zeros({1 << 20}, DType::F32, dev);
  side.wait(Stream::default_stream(dev));  // the tensors were made on the legacy default stream
  c->batch_send_recv({{P2POp::Send, x, next}, {P2POp::Recv, rx, prev}}, side)->wait();
  CHECK(rx.to_double_vector().front() == double(prev));
  c->barrier();
  if (me != 1) {
    // Rank 1 never posts this batch. Rank 2 (rank 0 with two ranks), which receives from rank 1, waits on the
    // host for rank 1's post until the timeout, then raises CommError and aborts its group. Every other rank's
    // call returns at once; whatever of its batch waits on the GPU for a rank that gave up (rank 0's send,
    // which rank 1 never reads; rank 3's receive from rank 2, which never wrote its flag) is let go by the
    // watchdog's abort after the timeout. No stream stays stuck and every rank but 1 ends aborted.
    const auto start = std::chrono::steady_clock::now();
    auto since = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
    if (me == 2 % n) {
      CHECK_THROWS_AS(c->batch_send_recv({{P2POp::Send, x, next}, {P2POp::Recv, rx, prev}}, side), CommError);
      CHECK(since() >= 3.0);
      CHECK(since() < 4.0 + 15.0);
    } else {
      c->batch_send_recv({{P2POp::Send, x, next}, {P2POp::Recv, rx, prev}}, side)->wait_on(consumer);
      CHECK(since() < 1.0);
      consumer.synchronize();
      CHECK(since() >= 3.0);
      CHECK(since() < 4.0 + 15.0);
      try {
        check_health();
      } catch (const CommError&) {
      }
    }
    CHECK(c->aborted());
    CHECK_THROWS_AS(c->batch_send_recv({{P2POp::Send, x, next}, {P2POp::Recv, rx, prev}}, side), CommError);
  }
  mpi->barrier();
  c->abort();
  CHECK(c->aborted());
}

#if MEGACORE_WITH_NCCL
// A send tensor that is not the caching allocator's (plain cudaMalloc, as torch's or a user's memory would be)
// cannot be pinned against the allocator's frees, so both sides move it with NCCL inside the same batch, in
// order with the copy-engine transfers around it: every value arrives, and the group stays on copy engines.
TEST_CASE("nccl copy-engine send/receive: foreign send memory goes by NCCL in the same batch",
          "[gpu][comm][copy_engine]") {
  MC_REQUIRE_GPU();
  uint64_t salt = fresh_salt();
  INFO("salt " << salt);
  CommOptions o = nccl_opts("ce_foreign");
  o.copy_engine = true;
  auto c = nccl_world(o);
  const int n = c->size(), me = c->rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  if (n < 2) return;
  REQUIRE(c->copy_engine_active());
  const Device dev = my_device();
  Stream s = Stream::create(dev);
  const int64_t cnt = 10000 + int64_t(salt % 1000);
  void* raw = nullptr;
  REQUIRE(cudaSetDevice(dev.index) == cudaSuccess);
  REQUIRE(cudaMalloc(&raw, size_t(cnt) * 4) == cudaSuccess);
  Tensor foreign = Tensor::from_blob(raw, {cnt}, {1}, DType::F32, dev, [raw] { cudaFree(raw); });
  foreign.copy_(make_on(DType::F32, values(DType::F32, cnt, me, salt), dev));
  Tensor before = make_on(DType::F32, values(DType::F32, 777, me, salt + 1), dev);
  Tensor after = make_on(DType::F32, values(DType::F32, 999, me, salt + 2), dev);
  Tensor r0 = Tensor::zeros({777}, DType::F32, dev), r1 = Tensor::zeros({cnt}, DType::F32, dev),
         r2 = Tensor::zeros({999}, DType::F32, dev);
  s.wait(Stream::default_stream(dev));  // the tensors were made on the legacy default stream
  c->batch_send_recv({{P2POp::Send, before, next}, {P2POp::Send, foreign, next}, {P2POp::Send, after, next},
                      {P2POp::Recv, r0, prev}, {P2POp::Recv, r1, prev}, {P2POp::Recv, r2, prev}},
                     s)
      ->wait();
  CHECK(r0.to_double_vector() == values(DType::F32, 777, prev, salt + 1));
  CHECK(r1.to_double_vector() == values(DType::F32, cnt, prev, salt));
  CHECK(r2.to_double_vector() == values(DType::F32, 999, prev, salt + 2));
}
#endif  // MEGACORE_WITH_NCCL
