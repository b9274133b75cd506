// Context parallelism's sequence layout (Megatron-Core / Transformer Engine load balancing for causal
// attention): a sequence of S tokens is cut into 2·CP chunks of c = S / (2·CP) tokens, and CP rank r
// holds chunks r and 2·CP−1−r, concatenated in that order (its local sequence of 2c tokens). Every rank
// then does the same amount of causal attention work: an early chunk (little to attend to) is paired
// with a late one. The model runs on local sequences; RoPE and learned positions use the global
// positions below; the loss sums over the CP group.
#pragma once

#include <cstdint>
#include <vector>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::parallel {

/// The global position of local token `local` (0 .. local_len − 1) of CP rank `rank` of `size`;
/// local_len = 2c must be even. size 1 is the identity.
int64_t cp_global_position(int64_t local, int64_t local_len, int rank, int size);

/// This CP rank's part of t along dimension `dim` (its length S must be a multiple of 2·size; ValueError
/// with the fix otherwise): chunks rank and 2·size−1−rank concatenated, as a new contiguous tensor on t's
/// device. size 1 returns t itself. Works for tokens, labels, masks and position ids ([b, s], dim 1) and
/// activations ([s, b, h], dim 0).
Tensor cp_slice_sequence(const Tensor& t, int64_t dim, int rank, int size, const Stream& s = {});

/// The inverse of cp_slice_sequence over the whole group: from every rank's local part (parts[r] is rank
/// r's), the full sequence along `dim` in global order (tests, and gathering results for inspection).
Tensor cp_unslice_sequence(const std::vector<Tensor>& parts, int64_t dim, const Stream& s = {});

}  // namespace megacore::parallel
