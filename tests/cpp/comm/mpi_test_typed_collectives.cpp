// Typed collectives (comm/collectives.hpp) under mpirun:
// every rank's result equals the single-rank result it computes locally from all ranks' inputs (each
// rank can draw every rank's input: the draws depend only on (seed, rank), and rank 0's fresh seed is
// broadcast with the typed broadcast first).
//
// Tolerances: integer reductions and max/min, gathers and broadcasts are exact; f32 sums differ from
// the local sum only in the order of additions (relative 1e-6).
#include <random>

#include "megacore/comm/collectives.hpp"
#include "megacore/comm/mpi_communicator.hpp"
#include "test_helpers.hpp"

using namespace megacore;

namespace {

std::unique_ptr<comm::Communicator> world_comm() {
  comm::CommOptions o;
  o.timeout = std::chrono::seconds(60);
  o.check_shapes = true;
  return comm::make_mpi_world(o);
}

// Rank 0's fresh seed, the same on every rank.
uint64_t shared_seed(comm::Communicator& w) {
  std::array<int64_t, 1> s{w.rank() == 0 ? int64_t(std::random_device{}() & 0x7fffffff) : 0};
  comm::broadcast(w, s, 0)->wait();
  return uint64_t(s[0]);
}

std::vector<float> draw(uint64_t seed, int rank, int64_t n) {
  Tensor t = Tensor::empty({n});
  Generator g(seed, uint64_t(rank) * 1000);
  t.normal_(g);
  return {t.data<float>(), t.data<float>() + n};
}

}  // namespace

TEST_CASE("typed all_reduce / all_gather / reduce_scatter / broadcast equal the single-rank result", "[comm][typed]") {
  auto w = world_comm();
  const int n = w->size(), me = w->rank();
  const uint64_t seed = shared_seed(*w);
  INFO("seed " << seed << " rank " << me);
  const int64_t len = 37;

  // f32 sum and max: against the local sum / max of every rank's draw.
  std::vector<std::vector<float>> all;
  for (int r = 0; r < n; ++r) all.push_back(draw(seed, r, len * n));
  std::vector<double> want_sum(size_t(len * n), 0.0);
  std::vector<float> want_max(size_t(len * n), -INFINITY);
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < want_sum.size(); ++i) {
      want_sum[i] += all[r][i];
      want_max[i] = std::max(want_max[i], all[r][i]);
    }
  std::vector<float> v = all[me];
  comm::all_reduce(*w, v, comm::ReduceOp::Sum)->wait();
  CHECK(mctest::rel_err(std::vector<double>(v.begin(), v.end()), want_sum) <= 1e-6);
  v = all[me];
  comm::all_reduce(*w, std::span(v), comm::ReduceOp::Max)->wait();
  CHECK(v == want_max);

  // The typed call and the runtime Tensor call agree exactly.
  std::vector<float> typed = all[me];
  comm::all_reduce(*w, typed, comm::ReduceOp::Avg)->wait();
  Tensor rt = Tensor::from_vector(all[me], {len * n});
  w->all_reduce(rt, comm::ReduceOp::Avg)->wait();
  CHECK(std::vector<float>(rt.data<float>(), rt.data<float>() + len * n) == typed);

  // int64 sum: exact.
  std::vector<int64_t> iv(5);
  for (int i = 0; i < 5; ++i) iv[size_t(i)] = int64_t(seed % 1000) * (me + 1) + i;
  comm::all_reduce(*w, iv)->wait();
  for (int i = 0; i < 5; ++i) CHECK(iv[size_t(i)] == int64_t(seed % 1000) * n * (n + 1) / 2 + int64_t(i) * n);

  // reduce_scatter: rank r gets chunk r of the sum.
  std::vector<float> rs(static_cast<size_t>(len));
  comm::reduce_scatter(*w, std::span<const float>(all[me]), std::span(rs))->wait();
  CHECK(mctest::rel_err(std::vector<double>(rs.begin(), rs.end()),
                        std::vector<double>(want_sum.begin() + me * len, want_sum.begin() + (me + 1) * len)) <= 1e-6);

  // all_gather of bf16: exact copies.
  std::vector<bfloat16> mine(static_cast<size_t>(len)), gathered(static_cast<size_t>(len * n));
  for (int64_t i = 0; i < len; ++i) mine[size_t(i)] = bfloat16(all[me][size_t(i)]);
  comm::all_gather(*w, std::span<const bfloat16>(mine), std::span(gathered))->wait();
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < len; ++i) CHECK(gathered[size_t(r * len + i)].bits == bfloat16(all[r][size_t(i)]).bits);

  // broadcast of u8 from the last rank.
  std::vector<uint8_t> bytes(9, uint8_t(me));
  comm::broadcast(*w, bytes, n - 1)->wait();
  CHECK(bytes == std::vector<uint8_t>(9, uint8_t(n - 1)));

  // The scalar form: max of one metric per rank.
  CHECK(comm::all_reduce_value(*w, float(all[me][0]), comm::ReduceOp::Max) == want_max[0]);
  CHECK(comm::all_reduce_value(*w, int32_t(me), comm::ReduceOp::Sum) == n * (n - 1) / 2);
}
