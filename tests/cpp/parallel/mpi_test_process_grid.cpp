// ProcessGrid over the MPI world: every group communicator holds exactly the ranks GridLayout names,
// and a reduction inside it sums exactly those ranks.
#include <numeric>

#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/parallel/process_grid.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::parallel;

namespace {
std::vector<ParallelConfig> configs_for(int world) {
  std::vector<ParallelConfig> out;
  for (int tp = 1; tp <= world; tp *= 2)
    for (int pp = 1; tp * pp <= world; pp *= 2)
      for (int cp = 1; tp * pp * cp <= world; cp *= 2) {
        if (world % (tp * pp * cp)) continue;
        int dp = world / (tp * pp * cp);
        for (int ep = 1; ep <= dp * cp; ep *= 2)
          if ((dp * cp) % ep == 0) out.push_back(ParallelConfig{tp, pp, cp, ep});
      }
  return out;
}
}  // namespace

TEST_CASE("ProcessGrid groups hold the layout's ranks and reduce over exactly them", "[grid][mpi]") {
  comm::CommOptions o;
  o.timeout = std::chrono::seconds(60);
  auto world = comm::make_mpi_world(o);
  for (const ParallelConfig& pc : configs_for(world->size())) {
    INFO("TP " << pc.tensor << " PP " << pc.pipeline << " CP " << pc.context << " EP " << pc.expert);
    ProcessGrid grid(*world, pc);
    const GridLayout& L = grid.layout();
    for (GroupKind k : kGroupKinds) {
      const auto& members = L.group_of(k, world->rank());
      REQUIRE(grid.has_group(k) == !members.empty());
      if (members.empty()) {
        REQUIRE_THROWS_WITH(grid.group(k), Catch::Contains("is in no"));
        continue;
      }
      comm::Communicator& g = grid.group(k);
      REQUIRE(g.name() == std::string(group_kind_name(k)));
      REQUIRE(g.world_ranks() == members);
      REQUIRE(g.rank() == L.rank_in_group(k, world->rank()));
      Tensor t = Tensor::full({3}, double(world->rank() + 1), DType::I64);
      g.all_reduce(t)->wait();
      int64_t expect = 0;
      for (int r : members) expect += r + 1;
      REQUIRE(t.to_double_vector() == std::vector<double>(3, double(expect)));
    }
    REQUIRE(grid.tp_rank() == L.tp_rank(world->rank()));
  }
}

TEST_CASE("an invalid grid is refused on every rank before any group is made", "[grid][mpi]") {
  auto world = comm::make_mpi_world();
  ParallelConfig bad{world->size() + 1, 1, 1, 1};
  REQUIRE_THROWS_AS(ProcessGrid(*world, bad), ConfigError);
  // No rank is left inside a split: the world still works.
  Tensor t = Tensor::full({1}, 1.0);
  world->all_reduce(t)->wait();
  REQUIRE(t.item() == double(world->size()));
}
