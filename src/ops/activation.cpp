#include "megacore/ops/activation.hpp"

#include "megacore/build_config.hpp"
#include "megacore/ops/ops_common.hpp"
#include "ops/activation_math.hpp"
#include "ops/cuda/activation_cuda.hpp"
#include "ops/memops_cpu.hpp"

namespace megacore::ops {
namespace {

static_assert(int(Activation::GeluErf) == int(actmath::Act::GeluErf) &&
              int(Activation::GeluTanh) == int(actmath::Act::GeluTanh) && int(Activation::Silu) == int(actmath::Act::Silu));

using cpu::ld;
using cpu::st;

template <class T>
void act_cpu(actmath::Act act, const T* x, const T* dy, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = ld(x[i]);
    out[i] = st<T>(dy ? ld(dy[i]) * actmath::derivative<double>(act, v) : actmath::forward<double>(act, v));
  }
}

template <class T>
void swiglu_cpu(const T* x, const T* dy, T* out, int64_t rows, int64_t f) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < f; ++c) {
      const double a = ld(x[r * 2 * f + c]), b = ld(x[r * 2 * f + f + c]);
      const double sg = actmath::sigmoid(a);
      if (dy) {
        const double g = ld(dy[r * f + c]);
        out[r * 2 * f + c] = st<T>(g * b * sg * (1 + a * (1 - sg)));
        out[r * 2 * f + f + c] = st<T>(g * a * sg);
      } else {
        out[r * f + c] = st<T>(a * sg * b);
      }
    }
  }
}

void check_same(const Tensor& t, const Tensor& x, const char* op, const char* name) {
  detail::check_defined(t, op, name);
  MC_CHECK(t.dtype() == x.dtype(), "{}: {} has dtype {} but x has {}; they must match", op, name, dtype_name(t.dtype()),
           dtype_name(x.dtype()));
  detail::check_contiguous(t, op, name);
  detail::check_same_device(t, x.device(), op, name);
}

void* stream_of(const Tensor& x, const Stream& s, const char* op) {
  return x.device().is_cuda() ? detail::launch_stream(s, x.device(), op) : nullptr;
}

}  // namespace

void activation_forward(Activation act, const Tensor& x, Tensor& y, const Stream& s) {
  const char* op = "activation_forward";
  detail::check_float_input(x, op, "x");
  check_same(y, x, op, "y");
  detail::check_shape(y, x.shape(), op, "y");
  void* stream = stream_of(x, s, op);
  const auto a = actmath::Act(int(act));
  if (x.device().is_cuda()) {
#if MEGACORE_WITH_CUDA
    cuda::activation(x.dtype(), a, x.data_ptr(), nullptr, y.data_ptr(), x.numel(), x.device().index, stream);
#endif
    return;
  }
  (void)stream;
  cpu::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    act_cpu<T>(a, x.data<T>(), nullptr, y.data<T>(), x.numel());
  });
}

void activation_backward(Activation act, const Tensor& dy, const Tensor& x, Tensor& dx, const Stream& s) {
  const char* op = "activation_backward";
  detail::check_float_input(x, op, "x");
  check_same(dy, x, op, "dy");
  detail::check_shape(dy, x.shape(), op, "dy");
  check_same(dx, x, op, "dx");
  detail::check_shape(dx, x.shape(), op, "dx");
  void* stream = stream_of(x, s, op);
  const auto a = actmath::Act(int(act));
  if (x.device().is_cuda()) {
#if MEGACORE_WITH_CUDA
    cuda::activation(x.dtype(), a, x.data_ptr(), dy.data_ptr(), dx.data_ptr(), x.numel(), x.device().index, stream);
#endif
    return;
  }
  (void)stream;
  cpu::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    act_cpu<T>(a, x.data<T>(), dy.data<T>(), dx.data<T>(), x.numel());
  });
}

namespace {
int64_t swiglu_check(const Tensor& x, const char* op) {
  detail::check_float_input(x, op, "x");
  MC_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0,
           "{}: x must be [..., 2F] holding [gate | up], got shape {} (last dimension not even)", op,
           shape_str(x.shape()));
  return x.size(-1) / 2;
}
Shape half_shape(const Tensor& x) {
  Shape sh = x.shape();
  sh.back() /= 2;
  return sh;
}
}  // namespace

void swiglu_forward(const Tensor& x, Tensor& y, const Stream& s) {
  const char* op = "swiglu_forward";
  const int64_t f = swiglu_check(x, op);
  check_same(y, x, op, "y");
  detail::check_shape(y, half_shape(x), op, "y");
  MC_CHECK(y.data_ptr() != x.data_ptr() || y.numel() == 0, "{}: y must not alias x", op);
  const int64_t rows = detail::leading_rows(x);
  void* stream = stream_of(x, s, op);
  if (x.device().is_cuda()) {
#if MEGACORE_WITH_CUDA
    cuda::swiglu(x.dtype(), x.data_ptr(), nullptr, y.data_ptr(), rows, f, x.device().index, stream);
#endif
    return;
  }
  (void)stream;
  cpu::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    swiglu_cpu<T>(x.data<T>(), nullptr, y.data<T>(), rows, f);
  });
}

void swiglu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, const Stream& s) {
  const char* op = "swiglu_backward";
  const int64_t f = swiglu_check(x, op);
  check_same(dy, x, op, "dy");
  detail::check_shape(dy, half_shape(x), op, "dy");
  check_same(dx, x, op, "dx");
  detail::check_shape(dx, x.shape(), op, "dx");
  const int64_t rows = detail::leading_rows(x);
  void* stream = stream_of(x, s, op);
  if (x.device().is_cuda()) {
#if MEGACORE_WITH_CUDA
    cuda::swiglu(x.dtype(), x.data_ptr(), dy.data_ptr(), dx.data_ptr(), rows, f, x.device().index, stream);
#endif
    return;
  }
  (void)stream;
  cpu::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    swiglu_cpu<T>(x.data<T>(), dy.data<T>(), dx.data<T>(), rows, f);
  });
}

namespace ref {
void activation_f64(Activation act, bool backward, const double* x, const double* dy, double* out, int64_t n) {
  act_cpu<double>(actmath::Act(int(act)), x, backward ? dy : nullptr, out, n);
}
void swiglu_f64(bool backward, const double* x, const double* dy, double* out, int64_t rows, int64_t f) {
  swiglu_cpu<double>(x, backward ? dy : nullptr, out, rows, f);
}
}  // namespace ref

}  // namespace megacore::ops
