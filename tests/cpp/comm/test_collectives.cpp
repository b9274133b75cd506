// Typed collectives (comm/collectives.hpp) on a one-rank group: the identity, with the size checks.
// The multi-rank checks are in mpi_test_typed_collectives.cpp.
#include "megacore/comm/collectives.hpp"
#include "test_helpers.hpp"

using namespace megacore;

TEST_CASE("typed collectives on a one-rank group are the identity and check sizes", "[comm][typed]") {
  mctest::SoloCommunicator solo(1, "world");
  std::vector<float> v{1.f, 2.f, 3.f};
  comm::all_reduce(solo, v, comm::ReduceOp::Sum)->wait();
  REQUIRE(v == std::vector<float>{1.f, 2.f, 3.f});
  std::vector<int64_t> out(3);
  comm::all_gather(solo, std::span<const int64_t>(std::vector<int64_t>{4, 5, 6}), std::span(out))->wait();
  REQUIRE(out == std::vector<int64_t>{4, 5, 6});
  REQUIRE(comm::all_reduce_value(solo, int32_t(7), comm::ReduceOp::Max) == 7);
  std::vector<int64_t> small(2);
  REQUIRE_THROWS_WITH(comm::all_gather(solo, std::span<const int64_t>(out), std::span(small)),
                      Catch::Contains("out has 2 elements but needs size() * in.size() = 1 * 3 = 3"));
}
