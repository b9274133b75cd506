// Combining partial attention results, for context parallelism (layers/attention.hpp, the CP ring).
//
// Attention of a query row over a key set K = K1 ∪ K2 can be computed block by block: each block gives a
// normalised output o_i and its log-sum-exp l_i, and the two combine exactly as
//   m = max(l1, l2),  o = (e^(l1−m)·o1 + e^(l2−m)·o2) / (e^(l1−m) + e^(l2−m)),  l = m + log(e^(l1−m) + e^(l2−m)).
// The accumulators are f32 so that merging CP partials rounds once per step, not once per step in bf16.
// Layouts are the SelfAttention layer's, sequence first:
//   out f32 [S, B, H, D] and lse f32 [B, H, S] (both contiguous) accumulate; a partial covers the query rows
//   [seq_offset, seq_offset + S_p): out_part [S_p, B, H, D] (f32, bf16 or f16) and lse_part f32 [B, H, S_p],
//   both contiguous. Start the accumulators at out = 0, lse = −inf (the first merge then copies).
// CPU and CUDA tensors (every operand on one device); the CUDA kernels run on the given stream.
#pragma once

#include <cstdint>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

/// Merges (out_part, lse_part) into the accumulators (out, lse) at query rows seq_offset.. (see above).
void attention_merge_partial(Tensor& out, Tensor& lse, const Tensor& out_part, const Tensor& lse_part,
                             int64_t seq_offset, const Stream& s = {});

/// dst (f32, contiguous) += src (f32, bf16 or f16, contiguous, dst's element count): the CP ring's
/// gradient accumulation (dQ locally, dK/dV along with their block).
void accumulate_f32(Tensor& dst, const Tensor& src, const Stream& s = {});

/// dst += src elementwise, added in f32 and rounded once to dst's dtype (a native add of that dtype).
/// @param dst  f32, bf16 or f16, contiguous, read and written
/// @param src  f32, bf16 or f16, contiguous, dst's element count, read
/// @param s    stream the kernel runs on (CUDA); last
/// The sequence-parallel row-parallel forward ring (layers/linear.hpp) sums its partial products with it.
void accumulate(Tensor& dst, const Tensor& src, const Stream& s = {});

}  // namespace megacore::ops
