// TypedMLP<T, Act>: a tensor-parallel MLP block, fc2(act(fc1(x))), with its parameter type and its
// activation fixed at compile time.
//
// fc1 is a ColumnParallelLinear and fc2 a RowParallelLinear (input_is_parallel), so the block has the
// same TP layout, sequence parallelism, initialisation and gradient accumulation as layers::MLP, and its
// GEMMs run through ops::gemm (cuBLASLt on CUDA, Eigen on the CPU). What the template adds is the
// activation: a policy Act (ops/functors.hpp contract) applied between the two GEMMs by ops::elementwise,
// on [..., ffn/TP], in f32 arithmetic, the way a CUTLASS epilogue functor is applied to a GEMM's output.
//
// Compiled into the library (src/layers/typed_mlp.cpp, declared extern below): T in {float, bfloat16,
// float16} x Act in ops::fn::{Relu, SquaredRelu, Silu, GeluTanh}. Any other Act is instantiated from
// this header by the user's code; on CUDA its kernel also needs MEGACORE_INSTANTIATE_ELEMENTWISE(T, Act)
// in a .cu (ops/elementwise.cuh). Gated activations (SwiGLU) are layers::MLP's.
//
// Saved activations: fc1's and fc2's inputs (as those layers save them) and fc1's output h, which
// backward needs for Act::grad(h). One forward is held at a time.
#pragma once

#include <cstdint>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/element_traits.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/linear.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/ops/elementwise.hpp"
#include "megacore/ops/functors.hpp"

namespace megacore::layers {

struct TypedMLPOptions {
  /// Biases on fc1 and fc2.
  bool bias = true;
  /// Input is this rank's sequence chunk [s/TP, ..., hidden]; the output is too (see linear.hpp).
  bool sequence_parallel = false;
  Device device = Device::cpu();
  double init_std = 0.02;
  uint64_t seed = 1234;
  /// Philox offset of fc1's full weight; fc2 draws from init_offset + 1.
  uint64_t init_offset = 0;
};

/// fc2(Act(fc1(x))) with parameters of type T (float, bfloat16 or float16).
template <FloatElement T, class Act>
class TypedMLP {
 public:
  using element_type = T;
  using activation_type = Act;

  /// `tp` must outlive the layer. ValueError naming the fix when ffn_hidden is not divisible by TP.
  /// @param hidden      input and output features
  /// @param ffn_hidden  fc1's output features (split over TP)
  /// @param act         the activation policy, copied
  TypedMLP(comm::Communicator& tp, int64_t hidden, int64_t ffn_hidden, const TypedMLPOptions& options = {},
           Act act = {})
      : fc1_(tp, hidden, ffn_hidden, fc1_options(options)),
        fc2_(tp, ffn_hidden, hidden, fc2_options(options)),
        act_(act) {}

  /// x: [..., hidden] of T (or [s/TP, ..., hidden] with sequence_parallel). Returns the same layout.
  Tensor forward(const ForwardContext& ctx, const Tensor& x) {
    Tensor h = fc1_.forward(ctx, x);
    Tensor a = Tensor::empty(h.shape(), h.dtype(), h.device(), ctx.stream);
    ops::elementwise<T>(h, a, act_, ctx.stream);
    saved_h_ = ctx.training ? h : Tensor();
    return fc2_.forward(ctx, a);
  }

  /// dy: gradient of forward's output. Accumulates every parameter's main_grad; returns dx.
  Tensor backward(const ForwardContext& ctx, const Tensor& dy) {
    static_assert(requires(const Act& a, compute_type_t<T> v) { a.grad(v); },
                  "TypedMLP::backward needs the activation's derivative: give Act a member `C grad(C x) const` "
                  "(C = float for float/bfloat16/float16), see ops/functors.hpp");
    MC_CHECK(saved_h_.defined(), "TypedMLP::backward: no saved forward; run forward with ctx.training = true first");
    Tensor da = fc2_.backward(ctx, dy);
    Tensor dh = da.contiguous(ctx.stream);
    ops::elementwise_grad<T>(dh, saved_h_, dh, act_, ctx.stream);
    saved_h_ = Tensor();
    return fc1_.backward(ctx, dh);
  }

  ColumnParallelLinear& fc1() { return fc1_; }
  RowParallelLinear& fc2() { return fc2_; }
  const Act& activation() const { return act_; }
  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> p = fc1_.parameters();
    for (Parameter* q : fc2_.parameters()) p.push_back(q);
    return p;
  }
  void zero_grad() {
    fc1_.zero_grad();
    fc2_.zero_grad();
  }

 private:
  static ColumnParallelLinearOptions fc1_options(const TypedMLPOptions& o) {
    ColumnParallelLinearOptions c;
    c.bias = o.bias;
    c.sequence_parallel = o.sequence_parallel;
    c.params_dtype = dtype_of_v<T>;
    c.device = o.device;
    c.init_std = o.init_std;
    c.seed = o.seed;
    c.init_offset = o.init_offset;
    return c;
  }
  static RowParallelLinearOptions fc2_options(const TypedMLPOptions& o) {
    RowParallelLinearOptions r;
    r.bias = o.bias;
    r.input_is_parallel = true;
    r.sequence_parallel = o.sequence_parallel;
    r.params_dtype = dtype_of_v<T>;
    r.device = o.device;
    r.init_std = o.init_std;
    r.seed = o.seed;
    r.init_offset = o.init_offset + 1;
    return r;
  }

  ColumnParallelLinear fc1_;
  RowParallelLinear fc2_;
  Act act_;
  Tensor saved_h_;  // fc1's output, for Act::grad
};

#define MC_TYPED_MLP_EXTERN(Act)                          \
  extern template class TypedMLP<float, Act>;             \
  extern template class TypedMLP<bfloat16, Act>;          \
  extern template class TypedMLP<float16, Act>;
MC_TYPED_MLP_EXTERN(ops::fn::Relu)
MC_TYPED_MLP_EXTERN(ops::fn::SquaredRelu)
MC_TYPED_MLP_EXTERN(ops::fn::Silu)
MC_TYPED_MLP_EXTERN(ops::fn::GeluTanh)
#undef MC_TYPED_MLP_EXTERN

}  // namespace megacore::layers
