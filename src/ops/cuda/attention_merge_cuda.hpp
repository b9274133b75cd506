// Private interface between src/ops/attention_merge.cpp and its CUDA kernels (attention_merge.cu).
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

/// The LSE merge of include/megacore/ops/attention_merge.hpp on device pointers: out f32 [S, B, H, D],
/// lse f32 [B, H, S], part (dtype dt) [Sp, B, H, D], lse_part f32 [B, H, Sp], all contiguous.
void attention_merge_partial(DType dt, float* out, float* lse, const void* part, const float* lse_part, int64_t S,
                             int64_t B, int64_t H, int64_t D, int64_t Sp, int64_t seq_offset, int device,
                             void* stream);

/// dst[i] += src[i] for n elements (in f32, rounded to dst's dtype dd); src of dtype ds.
void accumulate(DType dd, void* dst, DType ds, const void* src, int64_t n, int device, void* stream);

}  // namespace megacore::ops::cuda
