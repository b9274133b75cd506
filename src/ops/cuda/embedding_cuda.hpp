// Private interface between src/ops/embedding.cpp and its CUDA kernels (embedding.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

/// Launch shape of the embedding backward's segment sums. Internal, not user API: the library runs the
/// defaults; benchmarks/kernels/bench_optimizer.cpp times alternatives so that the defaults can be chosen
/// from one benchmark run. The result does not depend on it (same order of additions).
struct EmbeddingTuning {
  bool vector = true;  ///< 16-byte accesses (false: the first, element-wise kernel, one block per run)
  int threads = 256;   ///< per block; a block covers threads x unroll x (16 / sizeof(dout)) columns
                       ///< (H100, 16384 x 4096 bf16 -> f32 with the radix sort: 256 threads 78.6 % of
                       ///< copy, 128 76.3-78.1 %, the element kernel 68.1 %; kernels_NVIDIA_H100.json)
  int unroll = 2;      ///< 16-byte vectors per thread and gradient row: 1, 2 or 4
  int sort = 1;        ///< vector path only (same bits whatever it is): 0 CUB's stable radix sort (make_keys +
                       ///< about five kernels) and segment_sum_vec; 1 one cooperative counting-sort kernel
                       ///< (histogram, scan, scatter) and segment_sum_ordered, which puts each run back in
                       ///< token order and looks up key, neighbours and token in one round trip; 2 the radix
                       ///< sort with segment_sum_ordered (the lookups' share of 1's gain). H100, 16384 x
                       ///< 4096 bf16 -> f32, vocab 128256, sort included: 1 88.3 %, 2 76.5 %, 0 78.6 % of copy
};

/// vocab_start < 0: full table (out-of-range ids give NaN rows); else a shard (zero rows).
void embedding_forward(DType dt, const void* weight, const void* ids, bool ids_i64, void* out, int64_t n, int64_t v,
                       int64_t h, int64_t vocab_start, int device, void* stream);
size_t embedding_backward_workspace_bytes(int64_t n, int64_t v, int device);
void embedding_backward(DType dt, DType wdt, const void* dout, const void* ids, bool ids_i64, void* dweight, int64_t n,
                        int64_t v, int64_t h, int64_t vocab_start, bool accumulate, void* workspace,
                        size_t workspace_bytes, int device, void* stream, const EmbeddingTuning& tuning = {});

}  // namespace megacore::ops::cuda
