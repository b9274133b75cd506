#include "data/pinned_memory.hpp"

#include <cuda_runtime.h>

#include "megacore/core/error.hpp"

namespace megacore::data::detail {

void* pinned_alloc(size_t nbytes) {
  void* p = nullptr;
  cudaError_t e = cudaHostAlloc(&p, nbytes == 0 ? 1 : nbytes, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    raise<CudaError>("cudaHostAlloc of {} bytes for loader buffers failed: {}; lower prefetch or micro_batch_size, or "
                     "set pin_memory=false",
                     nbytes, cudaGetErrorString(e));
  }
  return p;
}

void pinned_free(void* p) {
  if (p) cudaFreeHost(p);
}

}  // namespace megacore::data::detail
