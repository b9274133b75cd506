// Helpers shared by the C++ tests.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "megacore/megacore.hpp"

namespace mctest {

/// Skips the rest of a GPU test case (Catch2 v2 has no SKIP) when there is no device.
#define MC_REQUIRE_GPU()                       \
  do {                                         \
    if (!::megacore::cuda_available()) {       \
      WARN("no CUDA device: test skipped");    \
      return;                                  \
    }                                          \
  } while (0)

/// ||a - b|| / ||b|| over two equally long vectors.
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / (std::sqrt(den) + 1e-300);
}

using namespace ::megacore;  // for the test communicator below (Tensor, Stream, comm::...)

/// A finished operation.
class DoneWork : public comm::Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

/// A one-rank group: every collective is the identity. `size` > 1 makes a group whose collectives
/// throw, for checks that must fail before communicating.
class SoloCommunicator : public comm::Communicator {
 public:
  explicit SoloCommunicator(int size = 1, std::string name = "tp") {
    rank_ = 0;
    size_ = size;
    options_.name = std::move(name);
  }
  comm::Backend backend() const override { return comm::Backend::MPI; }
  comm::WorkPtr all_reduce(Tensor&, comm::ReduceOp, const Stream&) override { return done(); }
  comm::WorkPtr all_gather(const Tensor& in, Tensor& out, const Stream& s) override {
    out.copy_(in.view(out.shape()), s);
    return done();
  }
  comm::WorkPtr reduce_scatter(const Tensor& in, Tensor& out, comm::ReduceOp, const Stream& s) override {
    out.copy_(in.view(out.shape()), s);
    return done();
  }
  comm::WorkPtr broadcast(Tensor&, int, const Stream&) override { return done(); }
  comm::WorkPtr all_to_all(const Tensor&, Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&,
                           const Stream&) override {
    throw std::logic_error("SoloCommunicator: all_to_all not expected");
  }
  comm::WorkPtr batch_send_recv(const std::vector<comm::P2POp>&, const Stream&) override {
    throw std::logic_error("SoloCommunicator: send/recv not expected");
  }
  void barrier() override {}
  std::unique_ptr<comm::Communicator> split(int, int, const comm::CommOptions&) override {
    throw std::logic_error("SoloCommunicator: split not expected");
  }
  void abort() override {}
  bool aborted() const override { return false; }

 private:
  comm::WorkPtr done() {
    if (size_ > 1) throw std::logic_error("test communicator: no collective expected here");
    return std::make_shared<DoneWork>();
  }
};

}  // namespace mctest
