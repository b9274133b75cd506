// The compiled instantiations of layers::TypedMLP (see layers/typed_mlp.hpp): the library's activation
// functors on the three float parameter types. Their CUDA kernels are in src/ops/cuda/elementwise.cu.
#include "megacore/layers/typed_mlp.hpp"

namespace megacore::layers {

#define MC_TYPED_MLP_INSTANTIATE(Act)        \
  template class TypedMLP<float, Act>;       \
  template class TypedMLP<bfloat16, Act>;    \
  template class TypedMLP<float16, Act>;
MC_TYPED_MLP_INSTANTIATE(ops::fn::Relu)
MC_TYPED_MLP_INSTANTIATE(ops::fn::SquaredRelu)
MC_TYPED_MLP_INSTANTIATE(ops::fn::Silu)
MC_TYPED_MLP_INSTANTIATE(ops::fn::GeluTanh)
#undef MC_TYPED_MLP_INSTANTIATE

}  // namespace megacore::layers
