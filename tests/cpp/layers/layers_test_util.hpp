// Helpers shared by the layer tests (embedding, cross-entropy, norm, MLP): a communicator that
// refuses every collective (for argument checks that must fail before communicating) and small
// tensor utilities for building single-rank references.
#pragma once

#include <chrono>
#include <memory>
#include <stdexcept>
#include <vector>

#include "test_helpers.hpp"

namespace layers_test {

using namespace megacore;

/// A group of `size` ranks seen from `rank` in which any collective throws std::logic_error.
class NoCommCommunicator : public comm::Communicator {
 public:
  NoCommCommunicator(int rank, int size) {
    rank_ = rank;
    size_ = size;
    options_.name = "tp";
  }
  comm::Backend backend() const override { return comm::Backend::MPI; }
  comm::WorkPtr all_reduce(Tensor&, comm::ReduceOp, const Stream&) override { fail(); }
  comm::WorkPtr all_gather(const Tensor&, Tensor&, const Stream&) override { fail(); }
  comm::WorkPtr reduce_scatter(const Tensor&, Tensor&, comm::ReduceOp, const Stream&) override { fail(); }
  comm::WorkPtr broadcast(Tensor&, int, const Stream&) override { fail(); }
  comm::WorkPtr all_to_all(const Tensor&, Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&,
                           const Stream&) override {
    fail();
  }
  comm::WorkPtr batch_send_recv(const std::vector<comm::P2POp>&, const Stream&) override { fail(); }
  void barrier() override { fail(); }
  std::unique_ptr<comm::Communicator> split(int, int, const comm::CommOptions&) override { fail(); }
  void abort() override {}
  bool aborted() const override { return false; }

 private:
  [[noreturn]] static void fail() { throw std::logic_error("test communicator: no collective expected here"); }
};

/// Standard-normal tensor, the same on every rank for the same (seed, offset).
inline Tensor randn(const Shape& shape, uint64_t offset, uint64_t seed = 77) {
  Tensor t = Tensor::empty(shape);
  Generator g(seed, offset);
  t.normal_(g);
  return t;
}

/// Chunk r of `parts` equal chunks along dim (contiguous copy).
inline Tensor chunk(const Tensor& t, int64_t dim, int parts, int r) {
  const int64_t n = t.size(dim) / parts;
  return t.narrow(dim, r * n, n).contiguous();
}

inline Tensor scaled(const Tensor& t, double k) {
  Tensor c = t.contiguous().clone();
  for (int64_t i = 0; i < c.numel(); ++i) c.data<float>()[i] = float(c.data<float>()[i] * k);
  return c;
}

/// SwiGLU fc1 rows [0, 2F) in the global [gate | up] order (the TP = 1 layout) → the concatenation over
/// the tpn ranks of [gate rows of rank q ; up rows of rank q], the layout the gathered fc1 shards have.
inline Tensor swiglu_rank_layout(const Tensor& t, int tpn) {
  const int64_t f = t.size(0) / 2, fl = f / tpn;
  Tensor out = Tensor::empty(t.shape());
  for (int q = 0; q < tpn; ++q) {
    out.narrow(0, 2 * q * fl, fl).copy_(t.narrow(0, q * fl, fl));
    out.narrow(0, (2 * q + 1) * fl, fl).copy_(t.narrow(0, f + q * fl, fl));
  }
  return out;
}

inline std::vector<int> tp_sizes_for(int world) {
  std::vector<int> out;
  for (int tp : {1, 2, 4})
    if (world % tp == 0) out.push_back(tp);
  return out;
}

inline void require_close(const Tensor& got, const Tensor& want, double tol, const char* what) {
  INFO(what << ": got " << got.str() << " want " << want.str());
  REQUIRE(got.shape() == want.shape());
  REQUIRE(mctest::rel_err(got.to_double_vector(), want.to_double_vector()) <= tol);
}

inline void require_equal(const Tensor& got, const Tensor& want, const char* what) {
  INFO(what << ": got " << got.str() << " want " << want.str());
  REQUIRE(got.shape() == want.shape());
  REQUIRE(got.to_double_vector() == want.to_double_vector());
}

inline std::unique_ptr<comm::Communicator> world_comm() {
  comm::CommOptions o;
  o.timeout = std::chrono::seconds(60);
  return comm::make_mpi_world(o);
}

}  // namespace layers_test
