// Embedding lookup and its deterministic backward.
//
// weight is [V, H] (f32/bf16/f16), ids any shape of i32/i64, out [*ids.shape, H] of weight's dtype.
// vocab_start < 0: the table is the whole vocabulary and every id must be in [0, V) (ValueError on
// the CPU; on the GPU an out-of-range id gives a NaN row, never another row's values).
// vocab_start >= 0: the table is a vocabulary shard [vocab_start, vocab_start + V) (Megatron's
// VocabParallelEmbedding); ids outside it give zero rows and no gradient.
// The backward sums the gradient rows of each id in token order without floating-point atomics
// (the GPU sorts the ids and gives each distinct id to one block), so it is bit-identical from run to run.
#pragma once

#include <cstdint>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

void embedding_forward(const Tensor& weight, const Tensor& ids, Tensor& out, int64_t vocab_start = -1,
                       const Stream& s = {});
/// dweight [V, H] (f32 or weight's dtype) gets the summed rows of dout; it is overwritten (rows of
/// ids that do not occur become zero), or added to when accumulate is true.
void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dweight, bool accumulate = false,
                        int64_t vocab_start = -1, const Stream& s = {});

}  // namespace megacore::ops
