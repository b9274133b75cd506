#include "megacore/ops/optimizer.hpp"

#include <cmath>

#include "megacore/build_config.hpp"
#include "megacore/ops/cast.hpp"
#include "megacore/ops/ops_common.hpp"
#include "ops/cuda/optimizer_cuda.hpp"
#include "ops/memops_cpu.hpp"

namespace megacore::ops {
namespace {

using cpu::ld;
using cpu::st;

/// Common checks of a list: same length as `count`, contiguous, dtype among `allowed`, one device.
void check_list(const std::vector<Tensor>& v, size_t count, const char* op, const char* name, Device d,
                std::initializer_list<DType> allowed, const std::vector<Tensor>* shapes_of = nullptr) {
  MC_CHECK(v.size() == count, "{}: {} has {} tensors but {} were expected (one per parameter)", op, name, v.size(),
           count);
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string nm = fmt::format("{}[{}]", name, i);
    detail::check_defined(v[i], op, nm);
    detail::check_contiguous(v[i], op, nm);
    detail::check_same_device(v[i], d, op, nm);
    bool ok = false;
    for (DType a : allowed) ok = ok || v[i].dtype() == a;
    MC_CHECK(ok, "{}: {} has dtype {}, which this list does not accept", op, nm, dtype_name(v[i].dtype()));
    MC_CHECK(v[i].dtype() == v[0].dtype(), "{}: {} has dtype {} but {}[0] has {}; use one dtype per list", op, nm,
             dtype_name(v[i].dtype()), name, dtype_name(v[0].dtype()));
    if (shapes_of)
      MC_CHECK(v[i].numel() == (*shapes_of)[i].numel(), "{}: {} has {} elements but its parameter has {}", op, nm,
               v[i].numel(), (*shapes_of)[i].numel());
  }
}

}  // namespace

void multi_tensor_adamw(const std::vector<Tensor>& grads, const std::vector<Tensor>& master,
                        const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
                        const std::vector<Tensor>& params_out, const AdamWHyper& h, const Tensor& gst,
                        const Stream& s) {
  const char* op = "multi_tensor_adamw";
  if (master.empty()) return;
  const Device d = master[0].device();
  const size_t k = master.size();
  check_list(master, k, op, "master", d, {DType::F32, DType::BF16});
  check_list(grads, k, op, "grads", d, {DType::F32, DType::BF16}, &master);
  check_list(exp_avg, k, op, "exp_avg", d, {DType::F32, DType::BF16}, &master);
  check_list(exp_avg_sq, k, op, "exp_avg_sq", d, {DType::F32, DType::BF16}, &master);
  if (!params_out.empty()) check_list(params_out, k, op, "params_out", d, {DType::F32, DType::BF16, DType::F16}, &master);
  MC_CHECK(master[0].dtype() == DType::F32 || params_out.empty(),
           "{}: master weights are bf16 (the parameters updated in place), so params_out must be empty", op);
  MC_CHECK(h.step >= 1, "{}: step must be >= 1 (1-based), got {}", op, h.step);
  MC_CHECK(h.beta1 >= 0 && h.beta1 < 1 && h.beta2 >= 0 && h.beta2 < 1, "{}: betas must be in [0, 1), got ({}, {})", op,
           h.beta1, h.beta2);
  MC_CHECK(h.eps > 0, "{}: eps must be > 0, got {}", op, h.eps);
  if (gst.defined()) {
    detail::check_dtype(gst, DType::F32, op, "grad_scale_tensor");
    detail::check_numel(gst, 1, op, "grad_scale_tensor");
    detail::check_same_device(gst, d, op, "grad_scale_tensor");
  }
  const double bc1 = 1.0 - std::pow(double(h.beta1), double(h.step));
  const double bc2 = 1.0 - std::pow(double(h.beta2), double(h.step));
  if (d.is_cuda()) {
    void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
    cuda::AdamWArgs a{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.grad_scale, float(bc1), float(bc2),
                      gst.defined() ? gst.data<float>() : nullptr};
    std::vector<std::vector<void*>> ptrs(k);
    std::vector<int64_t> n(k);
    for (size_t i = 0; i < k; ++i) {
      ptrs[i] = {grads[i].data_ptr(), master[i].data_ptr(), exp_avg[i].data_ptr(), exp_avg_sq[i].data_ptr(),
                 params_out.empty() ? nullptr : params_out[i].data_ptr()};
      n[i] = master[i].numel();
    }
    cuda::adamw({grads[0].dtype(), master[0].dtype(), exp_avg[0].dtype(), exp_avg_sq[0].dtype(),
                 params_out.empty() ? DType::F32 : params_out[0].dtype()},
                ptrs, n, a, d.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  const double gs = double(h.grad_scale) * (gst.defined() ? double(gst.data<float>()[0]) : 1.0);
  // Computed in double; each stored value is rounded once to its tensor's dtype (16-bit through f32, as the
  // kernels round), and the weight update uses the new moments before their rounding, as the kernels do.
  auto update = [&](auto gtag, auto wtag, auto mtag, auto vtag, size_t i) {
    using G = decltype(gtag);
    using W = decltype(wtag);
    using M = decltype(mtag);
    using V = decltype(vtag);
    const G* g = grads[i].data<G>();
    W* w = master[i].data<W>();
    M* m1 = exp_avg[i].data<M>();
    V* m2 = exp_avg_sq[i].data<V>();
    for (int64_t j = 0; j < master[i].numel(); ++j) {
      const double gv = ld(g[j]) * gs;
      double wv = ld(w[j]) * (1.0 - double(h.lr) * double(h.weight_decay));
      const double mv = double(h.beta1) * ld(m1[j]) + (1.0 - double(h.beta1)) * gv;
      const double vv = double(h.beta2) * ld(m2[j]) + (1.0 - double(h.beta2)) * gv * gv;
      wv -= double(h.lr) / bc1 * mv / (std::sqrt(vv) / std::sqrt(bc2) + double(h.eps));
      w[j] = st<W>(wv);
      m1[j] = st<M>(mv);
      m2[j] = st<V>(vv);
    }
  };
  // f32 or bf16 for the weights and each moment.
  auto f32_or_bf16 = [](DType dt, auto&& f) {
    if (dt == DType::BF16) f(bfloat16{});
    else f(float{});
  };
  for (size_t i = 0; i < k; ++i) {
    cpu::dispatch_float(grads[i].dtype(), [&](auto gtag) {
      f32_or_bf16(master[i].dtype(), [&](auto wtag) {
        f32_or_bf16(exp_avg[i].dtype(), [&](auto mtag) {
          f32_or_bf16(exp_avg_sq[i].dtype(), [&](auto vtag) { update(gtag, wtag, mtag, vtag, i); });
        });
      });
    });
    if (!params_out.empty()) {
      Tensor po = params_out[i];
      cast(master[i].view(po.shape()), po);
    }
  }
}

void multi_tensor_sgd(const std::vector<Tensor>& grads, const std::vector<Tensor>& master,
                      const std::vector<Tensor>& momentum, const std::vector<Tensor>& params_out, const SGDHyper& h,
                      const Tensor& gst, const Stream& s) {
  const char* op = "multi_tensor_sgd";
  if (master.empty()) return;
  const Device d = master[0].device();
  const size_t k = master.size();
  check_list(master, k, op, "master", d, {DType::F32});
  check_list(grads, k, op, "grads", d, {DType::F32, DType::BF16}, &master);
  const bool use_mom = h.momentum != 0.f;
  MC_CHECK(!use_mom || !momentum.empty(), "{}: momentum {} needs one momentum buffer per tensor (got none)", op,
           h.momentum);
  if (use_mom) check_list(momentum, k, op, "momentum", d, {DType::F32}, &master);
  if (!params_out.empty()) check_list(params_out, k, op, "params_out", d, {DType::F32, DType::BF16, DType::F16}, &master);
  MC_CHECK(h.momentum >= 0 && h.dampening >= 0 && h.weight_decay >= 0,
           "{}: momentum {}, dampening {} and weight_decay {} must be >= 0", op, h.momentum, h.dampening,
           h.weight_decay);
  MC_CHECK(!h.nesterov || (use_mom && h.dampening == 0), "{}: nesterov needs momentum > 0 and dampening 0", op);
  if (gst.defined()) {
    detail::check_dtype(gst, DType::F32, op, "grad_scale_tensor");
    detail::check_numel(gst, 1, op, "grad_scale_tensor");
    detail::check_same_device(gst, d, op, "grad_scale_tensor");
  }
  if (d.is_cuda()) {
    void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
    cuda::SGDArgs a{h.lr, h.momentum, h.dampening, h.weight_decay, h.grad_scale, h.nesterov, h.first_step,
                    gst.defined() ? gst.data<float>() : nullptr};
    std::vector<std::vector<void*>> ptrs(k);
    std::vector<int64_t> n(k);
    for (size_t i = 0; i < k; ++i) {
      ptrs[i] = {grads[i].data_ptr(), master[i].data_ptr(), use_mom ? momentum[i].data_ptr() : nullptr,
                 params_out.empty() ? nullptr : params_out[i].data_ptr()};
      n[i] = master[i].numel();
    }
    cuda::sgd(grads[0].dtype(), params_out.empty() ? DType::F32 : params_out[0].dtype(), ptrs, n, a, d.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  // f32 arithmetic in the same order as the CUDA kernel.
  const float sc = h.grad_scale * (gst.defined() ? gst.data<float>()[0] : 1.f);
  const float mu = h.momentum, damp = 1.f - h.dampening;
  for (size_t i = 0; i < k; ++i) {
    float* w = master[i].data<float>();
    float* buf = use_mom ? momentum[i].data<float>() : nullptr;
    cpu::dispatch_float(grads[i].dtype(), [&](auto gtag) {
      using G = decltype(gtag);
      const G* g = grads[i].data<G>();
      for (int64_t j = 0; j < master[i].numel(); ++j) {
        float dv = float(ld(g[j])) * sc + h.weight_decay * w[j];
        if (buf) {
          buf[j] = h.first_step ? dv : mu * buf[j] + damp * dv;
          dv = h.nesterov ? dv + mu * buf[j] : buf[j];
        }
        w[j] -= h.lr * dv;
      }
    });
    if (!params_out.empty()) {
      Tensor po = params_out[i];
      cast(master[i].view(po.shape()), po);
    }
  }
}

void multi_tensor_l2norm(const std::vector<Tensor>& tensors, Tensor& out, const Stream& s) {
  const char* op = "multi_tensor_l2norm";
  detail::check_dtype(out, DType::F32, op, "out");
  detail::check_numel(out, 1, op, "out");
  const Device d = out.device();
  if (!tensors.empty()) check_list(tensors, tensors.size(), op, "tensors", d, {DType::F32, DType::BF16, DType::F16});
  if (d.is_cuda()) {
    void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
    std::vector<const void*> p;
    std::vector<int64_t> n;
    for (const Tensor& t : tensors) {
      p.push_back(t.data_ptr());
      n.push_back(t.numel());
    }
    const size_t ws_bytes = cuda::l2norm_workspace_bytes(n);
    Tensor ws = Tensor::empty({int64_t(ws_bytes / 4)}, DType::F32, d, s);
    cuda::l2norm(tensors.empty() ? DType::F32 : tensors[0].dtype(), p, n, out.data<float>(), ws.data_ptr(), d.index,
                 stream);
#else
    (void)stream;
#endif
    return;
  }
  double acc = 0;
  for (const Tensor& t : tensors) {
    cpu::dispatch_float(t.dtype(), [&](auto tag) {
      using T = decltype(tag);
      const T* x = t.data<T>();
      for (int64_t j = 0; j < t.numel(); ++j) acc += ld(x[j]) * ld(x[j]);
    });
  }
  out.data<float>()[0] = float(std::sqrt(acc));
}

void multi_tensor_scale(const std::vector<Tensor>& src, const std::vector<Tensor>& dst, float scale,
                        const Tensor& scale_tensor, const Stream& s) {
  const char* op = "multi_tensor_scale";
  if (src.empty()) {
    MC_CHECK(dst.empty(), "{}: dst has {} tensors but src has none", op, dst.size());
    return;
  }
  const Device d = src[0].device();
  check_list(src, src.size(), op, "src", d, {DType::F32, DType::BF16, DType::F16});
  check_list(dst, src.size(), op, "dst", d, {DType::F32, DType::BF16, DType::F16}, &src);
  if (scale_tensor.defined()) {
    detail::check_dtype(scale_tensor, DType::F32, op, "scale_tensor");
    detail::check_numel(scale_tensor, 1, op, "scale_tensor");
    detail::check_same_device(scale_tensor, d, op, "scale_tensor");
  }
  if (d.is_cuda()) {
    void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
    std::vector<const void*> sp;
    std::vector<void*> dp;
    std::vector<int64_t> n;
    for (size_t i = 0; i < src.size(); ++i) {
      sp.push_back(src[i].data_ptr());
      dp.push_back(dst[i].data_ptr());
      n.push_back(src[i].numel());
    }
    cuda::scale(src[0].dtype(), dst[0].dtype(), sp, dp, n, scale,
                scale_tensor.defined() ? scale_tensor.data<float>() : nullptr, d.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  const float sc = scale * (scale_tensor.defined() ? scale_tensor.data<float>()[0] : 1.f);
  for (size_t i = 0; i < src.size(); ++i) {
    cpu::dispatch_float(src[i].dtype(), [&](auto stag) {
      cpu::dispatch_float(dst[i].dtype(), [&](auto dtag) {
        using S = decltype(stag);
        using D = decltype(dtag);
        const S* x = src[i].data<S>();
        D* y = dst[i].data<D>();
        // f32 product, as on the GPU, then one rounding to D
        for (int64_t j = 0; j < src[i].numel(); ++j) y[j] = st<D>(double(float(ld(x[j])) * sc));
      });
    });
  }
}

void clip_coefficient(const Tensor& norm, float max_norm, Tensor& coef, const Stream& s) {
  const char* op = "clip_coefficient";
  detail::check_dtype(norm, DType::F32, op, "norm");
  detail::check_numel(norm, 1, op, "norm");
  detail::check_dtype(coef, DType::F32, op, "coef");
  detail::check_numel(coef, 1, op, "coef");
  detail::check_same_device(coef, norm.device(), op, "coef");
  MC_CHECK(max_norm > 0, "{}: max_norm must be > 0, got {}", op, max_norm);
  if (norm.device().is_cuda()) {
    void* stream = detail::launch_stream(s, norm.device(), op);
#if MEGACORE_WITH_CUDA
    cuda::clip_coefficient(norm.data<float>(), max_norm, coef.data<float>(), norm.device().index, stream);
#else
    (void)stream;
#endif
    return;
  }
  coef.data<float>()[0] = std::min(1.f, max_norm / (norm.data<float>()[0] + 1e-6f));
}

}  // namespace megacore::ops
