// Private interface between src/ops/embedding.cpp and its CUDA kernels (embedding.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

/// vocab_start < 0: full table (out-of-range ids give NaN rows); else a shard (zero rows).
void embedding_forward(DType dt, const void* weight, const void* ids, bool ids_i64, void* out, int64_t n, int64_t v,
                       int64_t h, int64_t vocab_start, int device, void* stream);
size_t embedding_backward_workspace_bytes(int64_t n, int64_t v, int device);
void embedding_backward(DType dt, DType wdt, const void* dout, const void* ids, bool ids_i64, void* dweight, int64_t n,
                        int64_t v, int64_t h, int64_t vocab_start, bool accumulate, void* workspace,
                        size_t workspace_bytes, int device, void* stream);

}  // namespace megacore::ops::cuda
