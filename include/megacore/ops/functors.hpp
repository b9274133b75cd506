// Elementwise functors: the activation policies of the typed layers (layers/typed_mlp.hpp) and of
// ops::elementwise (ops/elementwise.hpp).
//
// A functor F is a policy in the CUTLASS epilogue sense: a small copyable struct, called per element on
// the host and on the device. Its contract:
//   C operator()(C x) const   the value,        with C = compute_type_t<T> (float for f32/bf16/f16)
//   C grad(C x) const         d value / d x,    needed only by backward passes
// Both are marked MC_HOST_DEVICE (core/dtype.hpp) to run in CUDA kernels too. Plain C++17, so the
// CUDA kernels (compiled as C++17) include this header as is. A user functor looks the same:
//
//   struct Square {
//     MC_HOST_DEVICE float operator()(float x) const { return x * x; }
//     MC_HOST_DEVICE float grad(float x) const { return 2.f * x; }
//   };
#pragma once

#include <math.h>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::fn {

/// max(x, 0).
struct Relu {
  template <class C> MC_HOST_DEVICE C operator()(C x) const { return x > C(0) ? x : C(0); }
  template <class C> MC_HOST_DEVICE C grad(C x) const { return x > C(0) ? C(1) : C(0); }
};

/// max(x, 0)^2 (Primer's squared ReLU).
struct SquaredRelu {
  template <class C> MC_HOST_DEVICE C operator()(C x) const { return x > C(0) ? x * x : C(0); }
  template <class C> MC_HOST_DEVICE C grad(C x) const { return x > C(0) ? C(2) * x : C(0); }
};

/// x sigmoid(x).
struct Silu {
  template <class C> MC_HOST_DEVICE C operator()(C x) const { return x / (C(1) + exp(-x)); }
  template <class C> MC_HOST_DEVICE C grad(C x) const {
    const C s = C(1) / (C(1) + exp(-x));
    return s * (C(1) + x * (C(1) - s));
  }
};

/// x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's gelu_new.
struct GeluTanh {
  template <class C> MC_HOST_DEVICE C operator()(C x) const {
    return C(0.5) * x * (C(1) + tanh(C(0.7978845608028654) * (x + C(0.044715) * x * x * x)));
  }
  template <class C> MC_HOST_DEVICE C grad(C x) const {
    const C u = C(0.7978845608028654) * (x + C(0.044715) * x * x * x);
    const C t = tanh(u);
    return C(0.5) * (C(1) + t) + C(0.5) * x * (C(1) - t * t) * C(0.7978845608028654) * (C(1) + C(3 * 0.044715) * x * x);
  }
};

}  // namespace megacore::ops::fn
