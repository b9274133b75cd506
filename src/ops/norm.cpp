#include "megacore/ops/norm.hpp"

#include <cmath>
#include <vector>

#include "megacore/build_config.hpp"
#include "megacore/ops/ops_common.hpp"
#include "ops/cuda/norm_cuda.hpp"
#include "ops/memops_cpu.hpp"

namespace megacore::ops {
namespace {

using cpu::ld;
using cpu::st;

template <class T, class S>
void norm_fwd_cpu(bool layer, const T* x, const T* res, const T* w, const T* b, T* y, T* res_out, S* mean, S* rstd,
                  int64_t rows, int64_t h, double eps) {
  std::vector<double> v(static_cast<size_t>(h));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = r * h;
    for (int64_t j = 0; j < h; ++j) {
      v[j] = ld(x[o + j]);
      if (res) {
        res_out[o + j] = st<T>(v[j] + ld(res[o + j]));
        v[j] = ld(res_out[o + j]);  // normalise the stored (rounded) sum, as backward sees it
      }
    }
    double mu = 0;
    if (layer) {
      for (int64_t j = 0; j < h; ++j) mu += v[j];
      mu /= double(h);
    }
    double var = 0;
    for (int64_t j = 0; j < h; ++j) var += (v[j] - mu) * (v[j] - mu);
    var /= double(h);
    const double rs = 1.0 / std::sqrt(var + eps);
    for (int64_t j = 0; j < h; ++j) {
      double o2 = (v[j] - mu) * rs * ld(w[j]);
      if (layer && b) o2 += ld(b[j]);
      y[o + j] = st<T>(o2);
    }
    if (layer) mean[r] = S(mu);
    rstd[r] = S(rs);
  }
}

template <class T, class S, class W>
void norm_bwd_cpu(bool layer, const T* dy, const T* dres, const T* x, const T* w, const S* mean, const S* rstd, T* dx,
                  W* dw, W* db, bool accumulate, int64_t rows, int64_t h) {
  std::vector<double> gw(static_cast<size_t>(h), 0.0), gb(static_cast<size_t>(h), 0.0), xh(static_cast<size_t>(h)), g(static_cast<size_t>(h));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = r * h;
    const double mu = layer ? double(mean[r]) : 0.0, rs = double(rstd[r]);
    double s1 = 0, s2 = 0;
    for (int64_t j = 0; j < h; ++j) {
      xh[j] = (ld(x[o + j]) - mu) * rs;
      g[j] = ld(dy[o + j]) * ld(w[j]);
      s1 += g[j];
      s2 += g[j] * xh[j];
    }
    const double m1 = layer ? s1 / double(h) : 0.0, m2 = s2 / double(h);
    for (int64_t j = 0; j < h; ++j) {
      double d = rs * (g[j] - m1 - xh[j] * m2);
      if (dres) d += ld(dres[o + j]);
      dx[o + j] = st<T>(d);
      gw[j] += ld(dy[o + j]) * xh[j];
      gb[j] += ld(dy[o + j]);
    }
  }
  for (int64_t j = 0; j < h; ++j) {
    dw[j] = st<W>((accumulate ? ld(dw[j]) : 0.0) + gw[j]);
    if (db) db[j] = st<W>((accumulate ? ld(db[j]) : 0.0) + gb[j]);
  }
}

constexpr const char* kFwdName[2] = {"rmsnorm_forward", "layernorm_forward"};
constexpr const char* kBwdName[2] = {"rmsnorm_backward", "layernorm_backward"};

void check_stats(const Tensor& t, int64_t rows, Device d, const char* op, const char* name) {
  detail::check_dtype(t, DType::F32, op, name);
  detail::check_numel(t, rows, op, name);
  detail::check_contiguous(t, op, name);
  detail::check_same_device(t, d, op, name);
}

void check_like(const Tensor& t, const Tensor& x, const char* op, const char* name) {
  detail::check_defined(t, op, name);
  MC_CHECK(t.dtype() == x.dtype(), "{}: {} has dtype {} but x has {}; they must match", op, name, dtype_name(t.dtype()),
           dtype_name(x.dtype()));
  detail::check_shape(t, x.shape(), op, name);
  detail::check_contiguous(t, op, name);
  detail::check_same_device(t, x.device(), op, name);
}

void check_param(const Tensor& t, const Tensor& x, int64_t h, const char* op, const char* name) {
  detail::check_defined(t, op, name);
  MC_CHECK(t.dtype() == x.dtype(), "{}: {} has dtype {} but x has {}; cast the parameter to x's dtype for the forward",
           op, name, dtype_name(t.dtype()), dtype_name(x.dtype()));
  detail::check_shape(t, Shape{h}, op, name);
  detail::check_contiguous(t, op, name);
  detail::check_same_device(t, x.device(), op, name);
}

void check_grad_param(const Tensor& t, const Tensor& x, int64_t h, const char* op, const char* name) {
  detail::check_float_input(t, op, name);
  detail::check_shape(t, Shape{h}, op, name);
  detail::check_same_device(t, x.device(), op, name);
}

void norm_forward_impl(bool layer, const Tensor& x, const Tensor* residual, const Tensor& w, const Tensor* b, Tensor& y,
                       Tensor* residual_out, Tensor* mean, Tensor& rstd, float eps, const Stream& s) {
  const char* op = kFwdName[layer];
  detail::check_float_input(x, op, "x");
  MC_CHECK(x.dim() >= 1 && x.size(-1) > 0, "{}: x must have a non-empty last (feature) dimension, got shape {}", op,
           shape_str(x.shape()));
  MC_CHECK(eps >= 0.f && std::isfinite(eps), "{}: eps must be finite and >= 0, got {}", op, eps);
  const int64_t h = x.size(-1), rows = detail::leading_rows(x);
  const Device d = x.device();
  check_param(w, x, h, op, "weight");
  if (b && b->defined()) check_param(*b, x, h, op, "bias");
  check_like(y, x, op, "y");
  if (residual) {
    check_like(*residual, x, op, "residual");
    check_like(*residual_out, x, op, "residual_out");
    // The kernels read x and residual while other threads write residual_out: the sum needs its own buffer.
    for (const Tensor* in : {&x, residual})
      MC_CHECK(!detail::overlaps(*residual_out, *in),
               "{}: residual_out must not share memory with x or residual; give it its own buffer", op);
  }
  if (mean) check_stats(*mean, rows, d, op, "mean");
  check_stats(rstd, rows, d, op, "rstd");
  void* stream = d.is_cuda() ? detail::launch_stream(s, d, op) : nullptr;

  const bool has_b = b && b->defined();
  if (d.is_cuda()) {
#if MEGACORE_WITH_CUDA
    cuda::NormForwardArgs a;
    a.layer = layer;
    a.x = x.data_ptr();
    a.residual = residual ? residual->data_ptr() : nullptr;
    a.w = w.data_ptr();
    a.b = has_b ? b->data_ptr() : nullptr;
    a.y = y.data_ptr();
    a.residual_out = residual ? residual_out->data_ptr() : nullptr;
    a.mean = mean ? mean->data<float>() : nullptr;
    a.rstd = rstd.data<float>();
    a.rows = rows;
    a.h = h;
    a.eps = eps;
    cuda::norm_forward(x.dtype(), a, d.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  cpu::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    norm_fwd_cpu<T, float>(layer, x.data<T>(), residual ? residual->data<T>() : nullptr, w.data<T>(),
                           has_b ? b->data<T>() : nullptr, y.data<T>(), residual ? residual_out->data<T>() : nullptr,
                           mean ? mean->data<float>() : nullptr, rstd.data<float>(), rows, h, double(eps));
  });
}

void norm_backward_impl(bool layer, const Tensor& dy, const Tensor* dres, const Tensor& x, const Tensor& w,
                        const Tensor* mean, const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor* db, bool accumulate,
                        const Stream& s) {
  const char* op = kBwdName[layer];
  detail::check_float_input(x, op, "x");
  MC_CHECK(x.dim() >= 1 && x.size(-1) > 0, "{}: x must have a non-empty last (feature) dimension, got shape {}", op,
           shape_str(x.shape()));
  const int64_t h = x.size(-1), rows = detail::leading_rows(x);
  const Device d = x.device();
  check_like(dy, x, op, "dy");
  if (dres) check_like(*dres, x, op, "dresidual_out");
  check_like(dx, x, op, "dx");
  check_param(w, x, h, op, "weight");
  if (mean) check_stats(*mean, rows, d, op, "mean");
  check_stats(rstd, rows, d, op, "rstd");
  check_grad_param(dw, x, h, op, "dweight");
  const bool has_db = db && db->defined();
  if (has_db) check_grad_param(*db, x, h, op, "dbias");
  void* stream = d.is_cuda() ? detail::launch_stream(s, d, op) : nullptr;

  if (d.is_cuda()) {
#if MEGACORE_WITH_CUDA
    cuda::NormBackwardArgs a;
    a.layer = layer;
    a.dy = dy.data_ptr();
    a.dresidual = dres ? dres->data_ptr() : nullptr;
    a.x = x.data_ptr();
    a.w = w.data_ptr();
    a.mean = mean ? mean->data<float>() : nullptr;
    a.rstd = rstd.data<float>();
    a.dx = dx.data_ptr();
    a.dw = dw.data_ptr();
    a.dw_dtype = dw.dtype();
    a.db = has_db ? db->data_ptr() : nullptr;
    a.db_dtype = has_db ? db->dtype() : DType::F32;
    a.accumulate = accumulate;
    a.rows = rows;
    a.h = h;
    size_t ws_bytes = cuda::norm_backward_workspace_bytes(a, x.dtype(), d.index);
    Tensor ws = Tensor::empty({int64_t(ws_bytes / 4 + 1)}, DType::F32, d, s);
    cuda::norm_backward(x.dtype(), a, ws.data_ptr(), d.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  cpu::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::dispatch_float(dw.dtype(), [&](auto wtag) {
      using W = decltype(wtag);
      MC_CHECK(!has_db || db->dtype() == dw.dtype(), "{}: dbias has dtype {} but dweight has {}; use one dtype for both",
               op, dtype_name(db->dtype()), dtype_name(dw.dtype()));
      norm_bwd_cpu<T, float, W>(layer, dy.data<T>(), dres ? dres->data<T>() : nullptr, x.data<T>(), w.data<T>(),
                                mean ? mean->data<float>() : nullptr, rstd.data<float>(), dx.data<T>(), dw.data<W>(),
                                has_db ? db->data<W>() : nullptr, accumulate, rows, h);
    });
  });
}

}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps, const Stream& s) {
  norm_forward_impl(false, x, nullptr, weight, nullptr, y, nullptr, nullptr, rstd, eps, s);
}

void rmsnorm_forward_residual(const Tensor& x, const Tensor& residual, const Tensor& weight, Tensor& y,
                              Tensor& residual_out, Tensor& rstd, float eps, const Stream& s) {
  norm_forward_impl(false, x, &residual, weight, nullptr, y, &residual_out, nullptr, rstd, eps, s);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd, Tensor& dx,
                      Tensor& dweight, const Stream& s, bool accumulate) {
  norm_backward_impl(false, dy, nullptr, x, weight, nullptr, rstd, dx, dweight, nullptr, accumulate, s);
}

void rmsnorm_backward_residual(const Tensor& dy, const Tensor& dresidual_out, const Tensor& x, const Tensor& weight,
                               const Tensor& rstd, Tensor& dx, Tensor& dweight, const Stream& s, bool accumulate) {
  norm_backward_impl(false, dy, &dresidual_out, x, weight, nullptr, rstd, dx, dweight, nullptr, accumulate, s);
}

void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, Tensor& mean,
                       Tensor& rstd, float eps, const Stream& s) {
  norm_forward_impl(true, x, nullptr, weight, &bias, y, nullptr, &mean, rstd, eps, s);
}

void layernorm_forward_residual(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                                Tensor& y, Tensor& residual_out, Tensor& mean, Tensor& rstd, float eps,
                                const Stream& s) {
  norm_forward_impl(true, x, &residual, weight, &bias, y, &residual_out, &mean, rstd, eps, s);
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dweight, Tensor& dbias, const Stream& s,
                        bool accumulate) {
  norm_backward_impl(true, dy, nullptr, x, weight, &mean, rstd, dx, dweight, &dbias, accumulate, s);
}

void layernorm_backward_residual(const Tensor& dy, const Tensor& dresidual_out, const Tensor& x,
                                 const Tensor& weight, const Tensor& mean, const Tensor& rstd, Tensor& dx,
                                 Tensor& dweight, Tensor& dbias, const Stream& s, bool accumulate) {
  norm_backward_impl(true, dy, &dresidual_out, x, weight, &mean, rstd, dx, dweight, &dbias, accumulate, s);
}

namespace ref {
void norm_forward_f64(bool layer, const double* x, const double* w, const double* b, double* y, double* mean,
                      double* rstd, int64_t rows, int64_t h, double eps) {
  norm_fwd_cpu<double, double>(layer, x, nullptr, w, b, y, nullptr, mean, rstd, rows, h, eps);
}
void norm_backward_f64(bool layer, const double* dy, const double* x, const double* w, const double* mean,
                       const double* rstd, double* dx, double* dw, double* db, int64_t rows, int64_t h) {
  norm_bwd_cpu<double, double, double>(layer, dy, nullptr, x, w, mean, rstd, dx, dw, db, false, rows, h);
}
}  // namespace ref

}  // namespace megacore::ops
