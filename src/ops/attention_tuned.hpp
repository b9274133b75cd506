// Private entry point for tests and benchmarks: attention_backward through megacore's flash kernel's
// atomic-dQ path with an explicit launch shape (attention_backward itself uses FlashBwdTuning{}).
#pragma once

#include "megacore/ops/attention.hpp"
#include "ops/cuda/attention_cuda.hpp"

namespace megacore::ops::detail {

/// attention_backward with backend Flash and deterministic false (whatever opts says), the atomic-dQ
/// kernel launched as `tuning` says. Same checks, errors and scratch buffers as attention_backward.
void attention_backward_flash_tuned(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                    const AttentionOptions& opts, const cuda::FlashBwdTuning& tuning,
                                    const Stream& s = {});

}  // namespace megacore::ops::detail
