// User-style functors for the typed-template tests: not among the library's ops::fn, so every use
// instantiates the templates from the headers (and, on CUDA builds, typed_functors.cu compiles their kernels
// with MEGACORE_INSTANTIATE_ELEMENTWISE, as a user's own .cu file would).
#pragma once

#include "megacore/ops/functors.hpp"

namespace mctest {

struct Square {
  MC_HOST_DEVICE float operator()(float x) const { return x * x; }
  MC_HOST_DEVICE float grad(float x) const { return 2.f * x; }
};

}  // namespace mctest
