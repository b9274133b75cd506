// ops::elementwise's kernels for the library's functors (ops/functors.hpp) on f32, bf16 and f16; the
// typed layers' compiled instantiations (src/layers/typed_mlp.cpp) call these.
#include "megacore/ops/elementwise.cuh"
#include "megacore/ops/functors.hpp"

#define MC_ELEMENTWISE_ALL_TYPES(F)                  \
  MEGACORE_INSTANTIATE_ELEMENTWISE(float, F)         \
  MEGACORE_INSTANTIATE_ELEMENTWISE(megacore::bfloat16, F) \
  MEGACORE_INSTANTIATE_ELEMENTWISE(megacore::float16, F)

MC_ELEMENTWISE_ALL_TYPES(megacore::ops::fn::Relu)
MC_ELEMENTWISE_ALL_TYPES(megacore::ops::fn::SquaredRelu)
MC_ELEMENTWISE_ALL_TYPES(megacore::ops::fn::Silu)
MC_ELEMENTWISE_ALL_TYPES(megacore::ops::fn::GeluTanh)
