// layers::TypedMLP with a user activation functor, TP over the whole world under mpirun, against the
// same layer at TP = 1 computed locally. The only differences are the order of the f32 partial sums,
// so relative 1e-5 (as in mpi_test_linear.cpp).
#include <random>

#include "megacore/comm/collectives.hpp"
#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/layers/typed_mlp.hpp"
#include "test_helpers.hpp"
#include "typed_functors.hpp"

using namespace megacore;
namespace ly = megacore::layers;

namespace {

std::unique_ptr<comm::Communicator> world_comm() {
  comm::CommOptions o;
  o.timeout = std::chrono::seconds(60);
  return comm::make_mpi_world(o);
}

// Rank 0's fresh seed, the same on every rank (the typed broadcast).
uint64_t shared_seed(comm::Communicator& w) {
  std::array<int64_t, 1> s{w.rank() == 0 ? int64_t(std::random_device{}() & 0x7fffffff) : 0};
  comm::broadcast(w, s, 0)->wait();
  return uint64_t(s[0]);
}

// Not one of ops::fn (tests/cpp/typed_functors.hpp): instantiated from the header here.
using mctest::Square;

}  // namespace

TEST_CASE("TypedMLP with a user functor, TP over the world, equals TP = 1", "[layers][typed]") {
  auto w = world_comm();
  const int n = w->size();
  const int64_t hidden = 8, ffn = 4 * n;
  const uint64_t seed = shared_seed(*w);
  INFO("seed " << seed << " tp " << n);
  const ly::TypedMLPOptions o{.init_std = 0.3, .seed = seed};
  ly::TypedMLP<float, Square> split(*w, hidden, ffn, o);
  mctest::SoloCommunicator solo;
  ly::TypedMLP<float, Square> whole(solo, hidden, ffn, o);

  Tensor x = Tensor::empty({3, 2, hidden}), dy = Tensor::empty({3, 2, hidden});
  Generator g(seed, 7);
  x.normal_(g);
  dy.normal_(g);
  ly::ForwardContext ctx;
  Tensor y1 = split.forward(ctx, x), yref = whole.forward(ctx, x);
  Tensor dx1 = split.backward(ctx, dy), dxref = whole.backward(ctx, dy);
  CHECK(mctest::rel_err(y1.to_double_vector(), yref.to_double_vector()) <= 1e-5);
  CHECK(mctest::rel_err(dx1.to_double_vector(), dxref.to_double_vector()) <= 1e-5);
  // This rank's rows of fc1's weight gradient.
  const int64_t per = ffn / n;
  Tensor dw1_ref = whole.fc1().weight().main_grad.narrow(0, w->rank() * per, per).contiguous();
  CHECK(mctest::rel_err(split.fc1().weight().main_grad.to_double_vector(), dw1_ref.to_double_vector()) <= 1e-5);
}
