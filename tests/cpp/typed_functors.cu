// The CUDA kernels of the tests' user functor, instantiated the way a user instantiates their own
// (docs/cpp.md): one line per element type.
#include "megacore/ops/elementwise.cuh"

#include "typed_functors.hpp"

MEGACORE_INSTANTIATE_ELEMENTWISE(float, mctest::Square)
MEGACORE_INSTANTIATE_ELEMENTWISE(megacore::bfloat16, mctest::Square)
