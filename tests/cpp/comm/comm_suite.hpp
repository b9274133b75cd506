// The collective checks shared by the MPI (CPU) and NCCL (GPU) multi-rank tests.
//
// Every rank's input is a deterministic function of (salt, rank), so each rank can regenerate all
// ranks' inputs locally and compute the exact expected result in float64.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "test_helpers.hpp"

namespace commtest {

using namespace megacore;
using namespace megacore::comm;

inline const DType kAllDTypes[] = {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8};
inline const ReduceOp kAllOps[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min};

/// The values rank `rank` contributes for draw `salt`, already rounded to dtype.
inline std::vector<double> values(DType dt, int64_t n, int rank, uint64_t salt) {
  Generator g(salt * 1000003 + uint64_t(rank) * 7919 + 1);
  Tensor f = Tensor::empty({n});
  bool is_int = !is_floating(dt);
  double lo = dt == DType::U8 ? 0 : is_int ? -100 : -1, hi = dt == DType::U8 ? 30 : is_int ? 100 : 1;
  f.uniform_(g, lo, hi);
  std::vector<double> v = f.to_double_vector();
  for (double& x : v) {
    if (is_int) x = std::floor(x);
    else if (dt == DType::BF16) x = double(float(bfloat16(float(x))));
    else if (dt == DType::F16) x = double(float(float16(float(x))));
  }
  return v;
}

/// A host tensor of dtype dt holding v (exactly representable by construction).
inline Tensor make(DType dt, const std::vector<double>& v) {
  Tensor t = Tensor::empty({int64_t(v.size())}, dt);
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(t.data_ptr());
    for (size_t i = 0; i < v.size(); ++i) {
      if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) p[i] = T(float(v[i]));
      else p[i] = T(v[i]);
    }
  });
  return t;
}

inline Tensor make_on(DType dt, const std::vector<double>& v, Device d) { return make(dt, v).to(d); }

/// Relative rounding unit of one reduction step in dtype dt (0 for exact types).
inline double unit(DType dt) {
  switch (dt) {
    case DType::F32: return 1.2e-7;
    case DType::BF16: return 7.9e-3;
    case DType::F16: return 9.8e-4;
    default: return 0;
  }
}

/// Checks got == want elementwise within what `steps` roundings of magnitude `scale[i]` allow.
inline void expect_close(const std::vector<double>& got, const std::vector<double>& want,
                         const std::vector<double>& scale, DType dt, int steps, const std::string& what) {
  INFO(what << " dtype " << dtype_name(dt));
  REQUIRE(got.size() == want.size());
  int bad = 0;
  size_t first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double tol = unit(dt) * (steps + 1) * scale[i] + (is_floating(dt) ? 1e-30 : 0);
    if (!(std::fabs(got[i] - want[i]) <= tol)) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad) {
    INFO("first mismatch at " << first << ": got " << got[first] << " want " << want[first]);
    CHECK(bad == 0);
  }
}

/// float64 reference of op over every rank's values; scale = sum of |x| per element.
inline void reference_reduce(DType dt, ReduceOp op, const std::vector<std::vector<double>>& all,
                             std::vector<double>& want, std::vector<double>& scale) {
  size_t n = all[0].size();
  want.assign(n, 0);
  scale.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    double acc = all[0][i];
    for (size_t r = 0; r < all.size(); ++r) {
      double x = all[r][i];
      scale[i] += std::fabs(x);
      if (r == 0) continue;
      if (op == ReduceOp::Sum || op == ReduceOp::Avg) acc += x;
      else if (op == ReduceOp::Max) acc = std::max(acc, x);
      else acc = std::min(acc, x);
    }
    if (op == ReduceOp::Avg) acc = is_floating(dt) ? acc / double(all.size()) : std::trunc(acc / double(all.size()));
    want[i] = acc;
  }
}

inline std::vector<std::vector<double>> all_values(DType dt, int64_t n, int size, uint64_t salt) {
  std::vector<std::vector<double>> all;
  for (int r = 0; r < size; ++r) all.push_back(values(dt, n, r, salt));
  return all;
}

// ---- the checks ------------------------------------------------------------------------------------

inline void check_all_reduce(Communicator& c, Device dev, const Stream& s) {
  uint64_t salt = 1;
  for (DType dt : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(1003)}) {
        ++salt;
        auto all = all_values(dt, n, c.size(), salt);
        Tensor t = make_on(dt, all[c.rank()], dev);
        c.all_reduce(t, op, s)->wait();
        std::vector<double> want, scale;
        reference_reduce(dt, op, all, want, scale);
        expect_close(t.to_double_vector(), want, scale, dt, c.size(),
                     "all_reduce " + std::string(reduce_op_name(op)) + " n=" + std::to_string(n));
      }
    }
  }
}

inline void check_broadcast(Communicator& c, Device dev, const Stream& s) {
  uint64_t salt = 100;
  for (DType dt : kAllDTypes) {
    for (int root : {0, c.size() - 1}) {
      for (int64_t n : {int64_t(1), int64_t(13), int64_t(1001)}) {
        ++salt;
        Tensor t = make_on(dt, values(dt, n, c.rank(), salt), dev);
        c.broadcast(t, root, s)->wait();
        std::vector<double> want = values(dt, n, root, salt);
        CHECK(t.to_double_vector() == want);
      }
    }
  }
}

inline void check_all_gather(Communicator& c, Device dev, const Stream& s) {
  uint64_t salt = 200;
  for (DType dt : kAllDTypes) {
    for (int64_t n : {int64_t(1), int64_t(5), int64_t(1003)}) {
      ++salt;
      Tensor in = make_on(dt, values(dt, n, c.rank(), salt), dev);
      Tensor out = Tensor::zeros({n * c.size()}, dt, dev);
      c.all_gather(in, out, s)->wait();
      std::vector<double> want;
      for (int r = 0; r < c.size(); ++r) {
        auto v = values(dt, n, r, salt);
        want.insert(want.end(), v.begin(), v.end());
      }
      CHECK(out.to_double_vector() == want);
    }
  }
}

inline void check_reduce_scatter(Communicator& c, Device dev, const Stream& s) {
  uint64_t salt = 300;
  for (DType dt : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      for (int64_t n : {int64_t(1), int64_t(17)}) {
        ++salt;
        auto all = all_values(dt, n * c.size(), c.size(), salt);
        Tensor in = make_on(dt, all[c.rank()], dev);
        Tensor out = Tensor::zeros({n}, dt, dev);
        c.reduce_scatter(in, out, op, s)->wait();
        std::vector<double> want, scale;
        reference_reduce(dt, op, all, want, scale);
        auto b = want.begin() + std::ptrdiff_t(n * c.rank());
        auto sb = scale.begin() + std::ptrdiff_t(n * c.rank());
        expect_close(out.to_double_vector(), std::vector<double>(b, b + n), std::vector<double>(sb, sb + n), dt,
                     c.size(), "reduce_scatter " + std::string(reduce_op_name(op)));
      }
    }
  }
}

/// Elements rank r sends to rank p in the uneven all-to-all (zeros included on purpose).
inline int64_t a2a_count(int r, int p) { return (r + 2 * p) % 4; }

inline void check_all_to_all(Communicator& c, Device dev, const Stream& s) {
  const int n = c.size(), me = c.rank();
  uint64_t salt = 400;
  for (DType dt : kAllDTypes) {
    // Even split.
    ++salt;
    const int64_t k = 3;
    Tensor in = make_on(dt, values(dt, k * n, me, salt), dev);
    Tensor out = Tensor::zeros({k * n}, dt, dev);
    c.all_to_all(in, out, {}, {}, s)->wait();
    std::vector<double> want;
    for (int p = 0; p < n; ++p) {
      auto v = values(dt, k * n, p, salt);
      want.insert(want.end(), v.begin() + k * me, v.begin() + k * (me + 1));
    }
    CHECK(out.to_double_vector() == want);

    // Uneven split.
    ++salt;
    std::vector<int64_t> sc(n), rc(n);
    int64_t total_in = 0, total_out = 0;
    for (int p = 0; p < n; ++p) {
      sc[p] = a2a_count(me, p);
      rc[p] = a2a_count(p, me);
      total_in += sc[p];
      total_out += rc[p];
    }
    Tensor uin = make_on(dt, values(dt, total_in, me, salt), dev);
    Tensor uout = Tensor::zeros({total_out}, dt, dev);
    c.all_to_all(uin, uout, sc, rc, s)->wait();
    want.clear();
    for (int p = 0; p < n; ++p) {
      int64_t p_total = 0, off = 0;
      for (int q = 0; q < n; ++q) {
        if (q == me) off = p_total;
        p_total += a2a_count(p, q);
      }
      auto v = values(dt, p_total, p, salt);
      want.insert(want.end(), v.begin() + off, v.begin() + off + a2a_count(p, me));
    }
    CHECK(uout.to_double_vector() == want);
  }
}

inline void check_ring_send_recv(Communicator& c, Device dev, const Stream& s) {
  const int n = c.size(), me = c.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  for (DType dt : kAllDTypes) {
    // Two messages to the same peer: they must arrive in posting order.
    Tensor a = make_on(dt, values(dt, 9, me, 500), dev), b = make_on(dt, values(dt, 4, me, 501), dev);
    Tensor ra = Tensor::zeros({9}, dt, dev), rb = Tensor::zeros({4}, dt, dev);
    std::vector<P2POp> ops{{P2POp::Send, a, next}, {P2POp::Send, b, next}, {P2POp::Recv, ra, prev},
                           {P2POp::Recv, rb, prev}};
    c.batch_send_recv(ops, s)->wait();
    CHECK(ra.to_double_vector() == values(dt, 9, prev, 500));
    CHECK(rb.to_double_vector() == values(dt, 4, prev, 501));
  }
  // The flight record names the last batch's peers as world ranks (the watchdog's report of a hung batch).
  if (const FlightRecorder* fr = c.flight_recorder()) {
    const FlightSnapshot snap = fr->snapshot();
    const FlightEntry* last = nullptr;
    for (const FlightEntry& e : snap.entries)
      if (e.p2p) last = &e;
    REQUIRE(last != nullptr);
    CHECK(last->send_to == std::vector<int>{c.world_ranks()[size_t(next)]});
    CHECK(last->recv_from == std::vector<int>{c.world_ranks()[size_t(prev)]});
  }
}

inline void check_split(Communicator& c, Device dev, const Stream& s, const CommOptions& base) {
  const int n = c.size(), me = c.rank();
  // Two groups by parity, ordered by descending rank through the key.
  CommOptions o = base;
  o.name = "parity";
  auto sub = c.split(me % 2, -me, o);
  REQUIRE(sub != nullptr);
  std::vector<int> members;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == me % 2) members.push_back(r);
  CHECK(sub->size() == int(members.size()));
  CHECK(members[sub->rank()] == me);
  std::vector<int> world;
  for (int m : members) world.push_back(c.world_ranks()[m]);
  CHECK(sub->world_ranks() == world);
  CHECK(sub->name() == "parity");
  Tensor t = make_on(DType::I64, {double(me)}, dev);
  sub->all_reduce(t, ReduceOp::Sum, s)->wait();
  double want = 0;
  for (int m : members) want += m;
  CHECK(t.to_double_vector()[0] == want);
  Tensor g = make_on(DType::I32, {double(me * 10)}, dev);
  Tensor go = Tensor::zeros({sub->size()}, DType::I32, dev);
  sub->all_gather(g, go, s)->wait();
  std::vector<double> gw;
  for (int m : members) gw.push_back(m * 10);
  CHECK(go.to_double_vector() == gw);
  sub->barrier();

  // A negative color joins no group; the others still form one.
  auto rest = c.split(me == 0 ? -1 : 7, me, o);
  if (me == 0) {
    CHECK(rest == nullptr);
  } else {
    REQUIRE(rest != nullptr);
    CHECK(rest->size() == n - 1);
    CHECK(rest->rank() == me - 1);
    Tensor one = make_on(DType::F32, {1.0}, dev);
    rest->all_reduce(one, ReduceOp::Sum, s)->wait();
    CHECK(one.to_double_vector()[0] == double(n - 1));
  }
}

/// check_shapes: a different element count (or dtype, or all-to-all counts) on one rank is a
/// CommError on every rank, and the communicator keeps working afterwards.
inline void check_check_shapes(Communicator& c, Device dev, const Stream& s) {
  const int me = c.rank();
  REQUIRE(c.options().check_shapes);
  Tensor t = Tensor::zeros({me == 1 ? 11 : 10}, DType::F32, dev);
  try {
    c.all_reduce(t, ReduceOp::Sum, s)->wait();
    FAIL("mismatched all_reduce did not throw");
  } catch (const CommError& e) {
    std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("check_shapes") != std::string::npos);
    CHECK(msg.find("ranks [1]: all_reduce(sum) f32 x11") != std::string::npos);
    CHECK(msg.find(c.name()) != std::string::npos);
  }
  Tensor d = Tensor::zeros({4}, me == 0 ? DType::F16 : DType::BF16, dev);
  CHECK_THROWS_AS(c.broadcast(d, 0, s)->wait(), CommError);
  // All-to-all where rank 0 expects one element too many from rank 1.
  const int n = c.size();
  std::vector<int64_t> sc(n, 2), rc(n, 2);
  if (me == 0) rc[1] = 3;
  int64_t tin = 2 * n, tout = 0;
  for (auto x : rc) tout += x;
  Tensor ain = Tensor::zeros({tin}, DType::F32, dev), aout = Tensor::zeros({tout}, DType::F32, dev);
  try {
    c.all_to_all(ain, aout, sc, rc, s)->wait();
    FAIL("mismatched all_to_all did not throw");
  } catch (const CommError& e) {
    std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("rank 1 sends 2 elements to rank 0, which expects 3") != std::string::npos);
  }
  // Still usable.
  Tensor ok = make_on(DType::F32, {1.0, 2.0}, dev);
  c.all_reduce(ok, ReduceOp::Sum, s)->wait();
  CHECK(ok.to_double_vector() == std::vector<double>{double(c.size()), 2.0 * c.size()});
  c.barrier();
}

}  // namespace commtest
