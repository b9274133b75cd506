// Stand-in for src/data/cuda/pinned_memory.cpp in builds without CUDA.
#include "megacore/build_config.hpp"
#if !MEGACORE_WITH_CUDA
#include "data/pinned_memory.hpp"
#include "megacore/core/error.hpp"

namespace megacore::data::detail {

void* pinned_alloc(size_t) {
  raise<CudaError>("page-locked memory needs CUDA; megacore was built without it (set pin_memory=false)");
}
void pinned_free(void*) {}

}  // namespace megacore::data::detail
#endif
