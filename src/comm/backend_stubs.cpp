// Factories of the backends this build lacks: they exist so callers link either way, and they say
// how to get the backend.
#include "comm/comm_detail.hpp"
#include "megacore/build_config.hpp"
#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/comm/nccl_communicator.hpp"

namespace megacore::comm {

#if !MEGACORE_WITH_MPI
bool mpi_available() { return false; }
size_t mpi_retained_communicators() { return 0; }
std::unique_ptr<Communicator> make_mpi_world(const CommOptions&) {
  raise<ConfigError>("this megacore was built without MPI, so host tensors have no communicator; install Open "
                     "MPI (libopenmpi-dev) and rebuild (cmake -DMEGACORE_MPI=ON)");
}
std::unique_ptr<Communicator> make_mpi_communicator(const void*, const CommOptions& o) { return make_mpi_world(o); }
namespace detail {
void mpi_abort_world(int) {}
}  // namespace detail
#endif

#if !MEGACORE_WITH_NCCL
void check_health() {}
bool nccl_available() { return false; }
int nccl_version() { return 0; }
NcclUniqueId nccl_unique_id() {
  raise<ConfigError>("this megacore was built without NCCL; install NCCL and rebuild (cmake -DMEGACORE_NCCL=ON)");
}
std::unique_ptr<Communicator> make_nccl_communicator(int, int, const NcclUniqueId&, Device, const CommOptions&) {
  nccl_unique_id();
  return nullptr;
}
#endif

}  // namespace megacore::comm
