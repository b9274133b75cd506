// ops::elementwise: a user functor (ops/functors.hpp) applied to every element of a tensor, on the CPU
// or on a CUDA device, with the math in compute_type_t<T> (float for f32/bf16/f16).
//
// CPU: a loop in this header, so any functor works. CUDA: the kernel template of ops/elementwise.cuh;
// the library compiles it for its own functors (ops::fn::*) on float/bfloat16/float16, and a user
// functor needs MEGACORE_INSTANTIATE_ELEMENTWISE(T, F) in one of the user's .cu files (a missing one is
// a link error naming megacore::ops::cuda_launch::elementwise<T, F, ...>).
#pragma once

#include <cstdint>

#include "megacore/build_config.hpp"
#include "megacore/core/element_traits.hpp"
#include "megacore/core/error.hpp"
#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/ops/functors.hpp"

namespace megacore::ops {

namespace cuda_launch {
/// Defined in ops/elementwise.cuh; see there.
template <class T, class F, bool Grad>
const char* elementwise(const T* x, const T* dy, T* out, int64_t n, F f, int device, void* stream);

#if MEGACORE_WITH_CUDA
#define MC_EXTERN_ELEMENTWISE(T, F)                                                                   \
  extern template const char* elementwise<T, F, false>(const T*, const T*, T*, int64_t, F, int, void*); \
  extern template const char* elementwise<T, F, true>(const T*, const T*, T*, int64_t, F, int, void*);
#define MC_EXTERN_ELEMENTWISE_ALL(F) \
  MC_EXTERN_ELEMENTWISE(float, F) MC_EXTERN_ELEMENTWISE(bfloat16, F) MC_EXTERN_ELEMENTWISE(float16, F)
MC_EXTERN_ELEMENTWISE_ALL(fn::Relu)
MC_EXTERN_ELEMENTWISE_ALL(fn::SquaredRelu)
MC_EXTERN_ELEMENTWISE_ALL(fn::Silu)
MC_EXTERN_ELEMENTWISE_ALL(fn::GeluTanh)
#undef MC_EXTERN_ELEMENTWISE_ALL
#undef MC_EXTERN_ELEMENTWISE
#endif
}  // namespace cuda_launch

namespace detail {
template <class T, bool Grad, class F>
void elementwise_impl(const Tensor& x, const Tensor* dy, Tensor& out, F f, const Stream& s) {
  constexpr DType dt = element_dtype<T>();
  using C = compute_type_t<T>;
  const char* what = Grad ? "ops::elementwise_grad" : "ops::elementwise";
  for (const Tensor* t : {&x, dy, static_cast<const Tensor*>(&out)}) {
    if (!t) continue;
    MC_CHECK(t->defined() && t->dtype() == dt, "{}: a tensor has dtype {} but T is {}; pass a {} tensor or call ops::{}<T> with T matching it",
             what, t->defined() ? dtype_name(t->dtype()) : "undefined", dtype_name(dt), dtype_name(dt),
             Grad ? "elementwise_grad" : "elementwise");
    MC_CHECK(t->is_contiguous(), "{}: tensors must be contiguous; call .contiguous() first", what);
    MC_CHECK(t->numel() == x.numel() && t->device() == x.device(),
             "{}: tensors must have x's {} elements on {}; got {} on {}", what, x.numel(), x.device().str(),
             t->numel(), t->device().str());
  }
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* dp = dy ? static_cast<const T*>(dy->data_ptr()) : nullptr;
  T* op = static_cast<T*>(out.data_ptr());
  const int64_t n = x.numel();
  if (x.device().is_cpu()) {
    for (int64_t i = 0; i < n; ++i) {
      const C v = C(xp[i]);
      if constexpr (Grad) op[i] = T(C(dp[i]) * C(f.grad(v)));
      else op[i] = T(C(f(v)));
    }
    return;
  }
#if MEGACORE_WITH_CUDA
  const char* err = cuda_launch::elementwise<T, F, Grad>(xp, dp, op, n, f, x.device().index, s.native());
  MC_CHECK_AS(CudaError, err == nullptr, "{} on {}: {}", what, x.device().str(), err ? err : "");
#else
  raise("{}: the tensor is on {} but this megacore was built without CUDA; use CPU tensors", what, x.device().str());
#endif
}
}  // namespace detail

/// y = f(x) elementwise.
/// @param x  [any shape] T, contiguous, read (CPU or CUDA)
/// @param y  x's element count, T, same device, written; may be x
/// @param f  the functor (ops/functors.hpp contract: C operator()(C))
/// @param s  stream the kernel runs on (CUDA); last
template <FloatElement T, class F>
void elementwise(const Tensor& x, Tensor& y, F f, const Stream& s = {}) {
  detail::elementwise_impl<T, false>(x, nullptr, y, f, s);
}

/// dx = dy * f.grad(x) elementwise (the backward of elementwise).
/// @param dy  x's element count, T, read
/// @param x   the forward's input, T, contiguous, read
/// @param dx  x's element count, T, written; may be dy
/// @param f   the functor (needs C grad(C))
/// @param s   stream the kernel runs on (CUDA); last
template <FloatElement T, class F>
void elementwise_grad(const Tensor& dy, const Tensor& x, Tensor& dx, F f, const Stream& s = {}) {
  detail::elementwise_impl<T, true>(x, &dy, dx, f, s);
}

}  // namespace megacore::ops
