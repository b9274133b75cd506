// The copy-engine transfers (src/comm/nccl/peer_copy.hpp) on their own, without NCCL: the processes of an MPI
// job exchange their setup through MPI and move data by CUDA IPC, flags and the host mailbox. Ranks share a GPU
// when there are fewer GPUs than ranks (CUDA IPC works between processes on one device; the copies are then
// local), so the protocol is checked on a one-GPU machine too:
//   mpirun -np 2 build/tests/megacore_mpi_tests "[peer_copy]"
// The NCCL communicator's use of it (CommOptions::copy_engine) is mpi_test_nccl.cpp's, on one GPU per rank.
#include "megacore/build_config.hpp"

#if MEGACORE_WITH_NCCL
#include <cuda_runtime.h>

#include <random>
#include <thread>

#include "comm/comm_suite.hpp"
#include "comm/nccl/peer_copy.hpp"
#include "megacore/core/allocator.hpp"

using namespace commtest;
using namespace std::chrono_literals;
using megacore::comm::detail::PeerCopy;
using megacore::comm::detail::PeerCopyTransfer;

namespace {

Device pc_device() { return Device::cuda(detect_launch_env().local_rank % cuda_device_count()); }

uint64_t pc_salt(Communicator& mpi) {
  Tensor t = Tensor::from_vector(std::vector<int64_t>{int64_t(std::random_device{}() & 0xffffff)}, {1});
  mpi.broadcast(t, 0)->wait();
  return uint64_t(t.item());
}

std::shared_ptr<PeerCopy> make_pc(Communicator& mpi, Device dev, size_t buffer, std::chrono::milliseconds timeout) {
  auto gather = [&](const std::vector<int64_t>& v) {
    Tensor in = Tensor::from_vector(v, {int64_t(v.size())});
    Tensor out = Tensor::empty({int64_t(v.size()) * mpi.size()}, DType::I64);
    mpi.all_gather(in, out)->wait();
    const int64_t* p = static_cast<const int64_t*>(out.data_ptr());
    return std::vector<int64_t>(p, p + out.numel());
  };
  std::string why;
  auto pc = PeerCopy::create(mpi.rank(), mpi.size(), dev.index, buffer, timeout, gather, &why);
  INFO("PeerCopy::create: " << why);
  REQUIRE(pc);
  return pc;
}

PeerCopyTransfer send_of(const Tensor& t, int peer) { return {true, peer, t.data_ptr(), size_t(t.nbytes())}; }
PeerCopyTransfer recv_of(const Tensor& t, int peer) { return {false, peer, t.data_ptr(), size_t(t.nbytes())}; }

// Host half and device half of one batch on `s`; the host half must succeed. The tests make their tensors on
// the device's legacy default stream, which a created (non-blocking) stream does not follow by itself.
void run_batch(PeerCopy& pc, std::vector<PeerCopyTransfer>& tr, const Stream& s) {
  s.wait(Stream::default_stream(s.device()));
  const std::string err = pc.post_and_match(tr, 20s, [] { return false; });
  INFO(err);
  REQUIRE(err.empty());
  REQUIRE(pc.send_recv(tr, static_cast<cudaStream_t>(s.native())) == cudaSuccess);
}

}  // namespace

// Send/receive batches: sends that are views at an offset inside a larger allocation; a batch of 150 transfers
// to one peer (more than the mailbox's 64 entries per pair: posting and reading progress together); send tensors
// written by a kernel on the batch's stream just before it (the copy must not read them early); fresh
// allocations each round and the cache emptied between rounds (the sent allocations are pinned: they stay
// reserved, are reused, and their mappings stay right); results read on another stream with no host wait.
TEST_CASE("peer copy: send/receive batches at offsets, beyond the mailbox's depth, right after their producer",
          "[gpu][comm][copy_engine][peer_copy]") {
  MC_REQUIRE_GPU();
  auto mpi = make_mpi_world();
  if (mpi->size() < 2) return;
  uint64_t salt = pc_salt(*mpi);
  INFO("salt " << salt);
  const Device dev = pc_device();
  auto pc = make_pc(*mpi, dev, size_t(256) << 10, 20s);
  const int n = mpi->size(), me = mpi->rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  Stream s = Stream::create(dev), consumer = Stream::create(dev);
  Allocator& alloc = Allocator::get(dev);
  void* last_pool = nullptr;
  for (int round = 0; round < 3; ++round) {
    ++salt;
    INFO("round " << round);
    // 1. Views at an offset: the peer maps the whole allocation and adds the offset.
    const int64_t big = ((int64_t(5) << 20) + 12345) / 4,  // a 6 MiB block, a size no other case pins
                 off = 12345 + int64_t(salt % 1000), len = 50000 + int64_t(salt % 777);
    Tensor pool = make_on(DType::F32, values(DType::F32, big, me, salt), dev);
    Tensor view = pool.narrow(0, off, len);
    last_pool = pool.data_ptr();
    Tensor got = Tensor::zeros({len}, DType::F32, dev);
    std::vector<PeerCopyTransfer> tr{send_of(view, next), recv_of(got, prev)};
    run_batch(*pc, tr, s);
    Event e1;
    e1.record(s);
    consumer.wait(e1);
    std::vector<double> all_prev = values(DType::F32, big, prev, salt);
    CHECK(got.to(Device::cpu(), consumer).to_double_vector() ==
          std::vector<double>(all_prev.begin() + off, all_prev.begin() + off + len));
    // 2. 150 sends to one peer in one batch (the pair's mailbox ring holds 64).
    std::vector<Tensor> outs, ins;
    std::vector<PeerCopyTransfer> many;
    for (int k = 0; k < 150; ++k) {
      outs.push_back(make_on(DType::I32, values(DType::I32, 1 + k, me, salt * 1000 + uint64_t(k)), dev));
      ins.push_back(Tensor::zeros({1 + k}, DType::I32, dev));
    }
    for (int k = 0; k < 150; ++k) many.push_back(send_of(outs[size_t(k)], next));
    for (int k = 0; k < 150; ++k) many.push_back(recv_of(ins[size_t(k)], prev));
    run_batch(*pc, many, s);
    Event e2;
    e2.record(s);
    consumer.wait(e2);
    for (int k = 0; k < 150; k += 7) {
      INFO("transfer " << k);
      CHECK(ins[size_t(k)].to(Device::cpu(), consumer).to_double_vector() ==
            values(DType::I32, 1 + k, prev, salt * 1000 + uint64_t(k)));
    }
    // 3. The send tensor is written on the batch's stream right before it, behind long kernels (20 fills of
    //    256 MiB): the receiver must see the new values, never the old ones.
    Tensor slow = Tensor::empty({int64_t(64) << 20}, DType::F32, dev, s);
    Tensor x = Tensor::full({1 << 16}, -1.0, DType::F32, dev, s);
    s.synchronize();
    mpi->barrier();
    for (int k = 0; k < 20; ++k) slow.fill_(double(k), s);
    x.fill_(double(me * 1000 + round), s);
    Tensor rx = Tensor::zeros({1 << 16}, DType::F32, dev);
    std::vector<PeerCopyTransfer> t3{send_of(x, next), recv_of(rx, prev)};
    run_batch(*pc, t3, s);
    Event e3;
    e3.record(s);
    consumer.wait(e3);
    std::vector<double> v = rx.to(Device::cpu(), consumer).to_double_vector();
    CHECK(std::all_of(v.begin(), v.end(), [&](double d) { return d == double(prev * 1000 + round); }));
    s.synchronize();
    consumer.synchronize();
    mpi->barrier();  // every peer has read this round's sends before they are freed
    alloc.empty_cache();  // the sent (pinned) blocks stay and are reused next round, mapped as they are
  }
  // The sent allocations are pinned: emptying the cache keeps them (still blocks of the allocator, free ones).
  alloc.empty_cache();
  CHECK(alloc.pin(last_pool));
  alloc.unpin(last_pool);
  mpi->barrier();
  // Teardown in turn: every rank but the last leaves its allocations pinned (a peer still maps them), the last one
  // finds every mapping closed and unpins, so its cache empties.
  for (int r = 0; r < n; ++r) {
    if (r == me) pc.reset();
    mpi->barrier();
  }
  alloc.empty_cache();
  const bool still_there = alloc.pin(last_pool);
  if (still_there) alloc.unpin(last_pool);
  CHECK(still_there == (me != n - 1));
  mpi->barrier();
}

// What the sender's memory decides and what a bad pair gets: a send tensor that is not the caching allocator's
// (plain cudaMalloc, as torch's or a user's memory would be) is marked "by NCCL" on both sides and skipped by
// the device half; a receive whose size differs from the send is an error naming both sizes.
TEST_CASE("peer copy: foreign send memory goes by NCCL on both sides, a size mismatch is an error",
          "[gpu][comm][copy_engine][peer_copy]") {
  MC_REQUIRE_GPU();
  auto mpi = make_mpi_world();
  if (mpi->size() < 2) return;
  const Device dev = pc_device();
  auto pc = make_pc(*mpi, dev, size_t(256) << 10, 20s);
  const int n = mpi->size(), me = mpi->rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  Stream s = Stream::create(dev);
  void* raw = nullptr;
  REQUIRE(cudaSetDevice(dev.index) == cudaSuccess);
  REQUIRE(cudaMalloc(&raw, 4096) == cudaSuccess);
  Tensor mine = Tensor::full({16}, double(me), DType::F32, dev);
  Tensor got = Tensor::zeros({1024}, DType::F32, dev), got2 = Tensor::zeros({16}, DType::F32, dev);
  std::vector<PeerCopyTransfer> tr{{true, next, raw, 4096}, send_of(mine, next), recv_of(got, prev), recv_of(got2, prev)};
  run_batch(*pc, tr, s);
  s.synchronize();
  CHECK(tr[0].nccl);
  CHECK_FALSE(tr[1].nccl);
  CHECK(tr[2].nccl);
  CHECK_FALSE(tr[3].nccl);
  CHECK(got2.to_double_vector() == std::vector<double>(16, double(prev)));
  cudaFree(raw);
  mpi->barrier();
  // A send to this rank itself must match its receive like any other.
  {
    Tensor s64 = Tensor::zeros({16}, DType::F32, dev), r32 = Tensor::zeros({8}, DType::F32, dev);
    std::vector<PeerCopyTransfer> t{send_of(s64, me), recv_of(r32, me)};
    CHECK_THAT(pc->post_and_match(t, 20s, [] { return false; }), Catch::Contains("its send to itself is 64"));
  }
  // Rank 0 sends 64 bytes to rank 1, which expects 128.
  Tensor a = Tensor::zeros({16}, DType::F32, dev), b = Tensor::zeros({32}, DType::F32, dev);
  if (me == 0) {
    std::vector<PeerCopyTransfer> t{send_of(a, 1)};
    CHECK(pc->post_and_match(t, 20s, [] { return false; }).empty());
  } else if (me == 1) {
    std::vector<PeerCopyTransfer> t{recv_of(b, 0)};
    const std::string err = pc->post_and_match(t, 20s, [] { return false; });
    CHECK_THAT(err, Catch::Contains("128 bytes but that rank sent 64"));
  }
  mpi->barrier();
}

// The collectives, many small chunks (a 64 KiB buffer), issued on two streams in turn with no host wait between
// them (all inputs made and ordered first, all results checked at the end), so that consecutive chunks of one slot
// may run on different streams at once: every all-gather exact, every sum within one rounding.
TEST_CASE("peer copy: all-gathers and reduce-scatters in many chunks across streams",
          "[gpu][comm][copy_engine][peer_copy]") {
  MC_REQUIRE_GPU();
  auto mpi = make_mpi_world();
  if (mpi->size() < 2) return;
  uint64_t salt = pc_salt(*mpi);
  INFO("salt " << salt);
  const Device dev = pc_device();
  auto pc = make_pc(*mpi, dev, size_t(64) << 10, 20s);
  const int n = mpi->size(), me = mpi->rank();
  Stream s1 = Stream::create(dev), s2 = Stream::create(dev);
  struct Round {
    int64_t count;
    uint64_t salt;
    Tensor in, out, rin, rout;
    std::vector<std::vector<double>> all;
  };
  std::vector<Round> rounds;
  for (int it = 0; it < 6; ++it) {
    Round r;
    r.salt = ++salt;
    r.count = 30000 + int64_t(salt % 5000);
    r.in = make_on(DType::F32, values(DType::F32, r.count, me, salt), dev);
    r.out = Tensor::zeros({r.count * n}, DType::F32, dev);
    r.all = all_values(DType::F32, r.count * n, n, salt + 99);
    r.rin = make_on(DType::F32, r.all[size_t(me)], dev);
    r.rout = Tensor::zeros({r.count}, DType::F32, dev);
    rounds.push_back(std::move(r));
  }
  s1.wait(Stream::default_stream(dev));  // the tensors were made on the legacy default stream
  s2.wait(Stream::default_stream(dev));
  for (size_t it = 0; it < rounds.size(); ++it) {
    Round& r = rounds[it];
    auto st = static_cast<cudaStream_t>((it % 2 ? s2 : s1).native());
    REQUIRE(pc->all_gather(r.in.data_ptr(), r.out.data_ptr(), size_t(r.in.nbytes()), st) == cudaSuccess);
    REQUIRE(pc->reduce_scatter_sum(r.rin.data_ptr(), r.rout.data_ptr(), r.count, DType::F32, st) == cudaSuccess);
  }
  s1.synchronize();
  s2.synchronize();
  for (Round& r : rounds) {
    std::vector<double> want;
    for (int k = 0; k < n; ++k) {
      auto v = values(DType::F32, r.count, k, r.salt);
      want.insert(want.end(), v.begin(), v.end());
    }
    CHECK(r.out.to_double_vector() == want);
    std::vector<double> rw, scale;
    reference_reduce(DType::F32, ReduceOp::Sum, r.all, rw, scale);
    const int64_t c = r.count;
    expect_close(r.rout.to_double_vector(), std::vector<double>(rw.begin() + c * me, rw.begin() + c * (me + 1)),
                 std::vector<double>(scale.begin() + c * me, scale.begin() + c * (me + 1)), DType::F32, 1,
                 "peer copy reduce_scatter");
  }
  mpi->barrier();
}

// Teardown with a transfer still waiting: rank 1 sends to rank 0, which never receives it, so rank 1's stream
// waits for a "read" flag that never comes. Destroying rank 1's PeerCopy returns within about twice the
// timeout (it waits the timeout, then releases its flags), and the stream waiting on the send goes on.
TEST_CASE("peer copy: destroying it with a send nobody receives ends within the timeout",
          "[gpu][comm][copy_engine][peer_copy]") {
  MC_REQUIRE_GPU();
  auto mpi = make_mpi_world();
  if (mpi->size() < 2) return;
  const Device dev = pc_device();
  auto pc = make_pc(*mpi, dev, size_t(64) << 10, 2s);
  const int me = mpi->rank();
  Stream s = Stream::create(dev);
  Tensor x = Tensor::full({1024}, 1.0, DType::F32, dev);
  if (me == 1) {
    std::vector<PeerCopyTransfer> t{send_of(x, 0)};
    REQUIRE(pc->post_and_match(t, 2s, [] { return false; }).empty());
    REQUIRE(pc->send_recv(t, static_cast<cudaStream_t>(s.native())) == cudaSuccess);
    std::this_thread::sleep_for(100ms);
    CHECK(cudaStreamQuery(static_cast<cudaStream_t>(s.native())) == cudaErrorNotReady);  // waiting for rank 0
    const auto start = std::chrono::steady_clock::now();
    pc.reset();
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(took >= 1.5);
    CHECK(took < 2 * 2.0 + 3.0);
    s.synchronize();  // released: returns
  } else {
    pc.reset();
  }
  mpi->barrier();
}

#endif  // MEGACORE_WITH_NCCL
