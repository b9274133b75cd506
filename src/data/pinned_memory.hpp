// Page-locked host memory for the loader's buffers (private to src/data).
#pragma once

#include <cstddef>

namespace megacore::data::detail {

/// Page-locked host memory of nbytes; throws CudaError when CUDA cannot provide it.
void* pinned_alloc(size_t nbytes);
void pinned_free(void* p);

}  // namespace megacore::data::detail
