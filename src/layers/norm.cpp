#include "megacore/layers/norm.hpp"

#include "megacore/ops/norm.hpp"

namespace megacore::layers {

NormLayer::NormLayer(bool layernorm, int64_t hidden_size, const NormOptions& options)
    : layer_(layernorm), hidden_(hidden_size), opts_(options) {
  const char* name = layer_ ? "LayerNorm" : "RMSNorm";
  MC_CHECK(hidden_ > 0, "{}: hidden_size is {}; pass the (positive) size of the normalised last dimension", name,
           hidden_);
  MC_CHECK(opts_.eps > 0, "{}: eps is {}; use a small positive value (1e-5)", name, opts_.eps);
  MC_CHECK(is_floating(opts_.params_dtype), "{}: params_dtype {} is not a float type; use f32, bf16 or f16", name,
           dtype_name(opts_.params_dtype));
  weight_.name = "weight";
  weight_.data = Tensor::full({hidden_}, 1.0, opts_.params_dtype, opts_.device);
  weight_.main_grad = Tensor::zeros({hidden_}, DType::F32, opts_.device);
  weight_.sequence_parallel = opts_.sequence_parallel;
  if (layer_ && opts_.bias) {
    bias_.name = "bias";
    bias_.data = Tensor::zeros({hidden_}, opts_.params_dtype, opts_.device);
    bias_.main_grad = Tensor::zeros({hidden_}, DType::F32, opts_.device);
    bias_.sequence_parallel = opts_.sequence_parallel;
  }
}

void NormLayer::check_input(const Tensor& t, std::string_view where, std::string_view what) const {
  const char* name = layer_ ? "LayerNorm" : "RMSNorm";
  MC_CHECK(t.defined(), "{}.{}: {} is undefined; pass the output of the previous layer", name, where, what);
  MC_CHECK(t.dim() >= 1 && t.size(-1) == hidden_,
           "{}.{}: {} has shape {} but its last dimension must be hidden_size {}; pass [..., {}]", name, where, what,
           shape_str(t.shape()), hidden_, hidden_);
  MC_CHECK(t.dtype() == opts_.params_dtype,
           "{}.{}: {} has dtype {} but the layer's parameters are {}; convert it with .to(DType::{})", name, where,
           what, dtype_name(t.dtype()), dtype_name(opts_.params_dtype), dtype_name(opts_.params_dtype));
  MC_CHECK(t.device() == opts_.device, "{}.{}: {} is on {} but the layer is on {}; move it with .to(Device)", name,
           where, what, t.device().str(), opts_.device.str());
}

Tensor NormLayer::forward(const ForwardContext& ctx, const Tensor& x) {
  const Stream& s = ctx.stream;
  check_input(x, "forward", "the input");
  Tensor xc = x.contiguous(s);
  const int64_t rows = xc.numel() / hidden_;
  Tensor y = Tensor::empty(xc.shape(), opts_.params_dtype, opts_.device, s);
  Tensor rstd = Tensor::empty({rows}, DType::F32, opts_.device, s);
  Tensor mean;
  if (layer_) {
    mean = Tensor::empty({rows}, DType::F32, opts_.device, s);
    ops::layernorm_forward(xc, weight_.data, bias_.data, y, mean, rstd, float(opts_.eps), s);
  } else {
    ops::rmsnorm_forward(xc, weight_.data, y, rstd, float(opts_.eps), s);
  }
  if (ctx.training) {
    saved_x_ = xc;
    saved_mean_ = mean;
    saved_rstd_ = rstd;
    saved_fused_ = false;
  } else {
    saved_x_ = Tensor();
  }
  return y;
}

NormResidualOutput NormLayer::forward_residual(const ForwardContext& ctx, const Tensor& x, const Tensor& residual) {
  const Stream& s = ctx.stream;
  check_input(x, "forward_residual", "the input");
  check_input(residual, "forward_residual", "the residual");
  const char* name = layer_ ? "LayerNorm" : "RMSNorm";
  MC_CHECK(x.shape() == residual.shape(),
           "{}.forward_residual: the input has shape {} but the residual {}; pass tensors of the same shape", name,
           shape_str(x.shape()), shape_str(residual.shape()));
  Tensor xc = x.contiguous(s), rc = residual.contiguous(s);
  const int64_t rows = xc.numel() / hidden_;
  NormResidualOutput out;
  out.y = Tensor::empty(xc.shape(), opts_.params_dtype, opts_.device, s);
  out.residual_out = Tensor::empty(xc.shape(), opts_.params_dtype, opts_.device, s);
  Tensor rstd = Tensor::empty({rows}, DType::F32, opts_.device, s);
  Tensor mean;
  if (layer_) {
    mean = Tensor::empty({rows}, DType::F32, opts_.device, s);
    ops::layernorm_forward_residual(xc, rc, weight_.data, bias_.data, out.y, out.residual_out, mean, rstd,
                                    float(opts_.eps), s);
  } else {
    ops::rmsnorm_forward_residual(xc, rc, weight_.data, out.y, out.residual_out, rstd, float(opts_.eps), s);
  }
  if (ctx.training) {
    saved_x_ = out.residual_out;  // backward normalises h = x + residual
    saved_mean_ = mean;
    saved_rstd_ = rstd;
    saved_fused_ = true;
  } else {
    saved_x_ = Tensor();
  }
  return out;
}

Tensor NormLayer::backward(const ForwardContext& ctx, const Tensor& dy) { return backward_common(ctx, dy, nullptr); }

Tensor NormLayer::backward_residual(const ForwardContext& ctx, const Tensor& dy, const Tensor& dresidual_out) {
  return backward_common(ctx, dy, &dresidual_out);
}

Tensor NormLayer::backward_common(const ForwardContext& ctx, const Tensor& dy, const Tensor* dres) {
  const Stream& s = ctx.stream;
  const char* name = layer_ ? "LayerNorm" : "RMSNorm";
  const char* where = dres ? "backward_residual" : "backward";
  MC_CHECK(saved_x_.defined(),
           "{}.{}: no saved input; call forward with ctx.training = true before backward (each forward allows one "
           "backward)",
           name, where);
  MC_CHECK(saved_fused_ == (dres != nullptr),
           "{}.{}: the last forward was {}; pair forward with backward and forward_residual with backward_residual",
           name, where, saved_fused_ ? "forward_residual" : "forward");
  check_input(dy, where, "dy");
  MC_CHECK(dy.shape() == saved_x_.shape(),
           "{}.{}: dy has shape {} but forward's output had {}; pass the gradient of forward's output", name, where,
           shape_str(dy.shape()), shape_str(saved_x_.shape()));
  Tensor dyc = dy.contiguous(s);
  Tensor dx = Tensor::empty(saved_x_.shape(), opts_.params_dtype, opts_.device, s);
  Tensor db = bias_.main_grad;  // undefined without bias: the op skips it
  if (dres) {
    check_input(*dres, where, "dresidual_out");
    MC_CHECK(dres->shape() == saved_x_.shape(), "{}.{}: dresidual_out has shape {}, expected {}", name, where,
             shape_str(dres->shape()), shape_str(saved_x_.shape()));
    Tensor drc = dres->contiguous(s);
    if (layer_)
      ops::layernorm_backward_residual(dyc, drc, saved_x_, weight_.data, saved_mean_, saved_rstd_, dx,
                                       weight_.main_grad, db, s, /*accumulate=*/true);
    else
      ops::rmsnorm_backward_residual(dyc, drc, saved_x_, weight_.data, saved_rstd_, dx, weight_.main_grad, s,
                                     /*accumulate=*/true);
  } else {
    if (layer_)
      ops::layernorm_backward(dyc, saved_x_, weight_.data, saved_mean_, saved_rstd_, dx, weight_.main_grad, db, s,
                              /*accumulate=*/true);
    else
      ops::rmsnorm_backward(dyc, saved_x_, weight_.data, saved_rstd_, dx, weight_.main_grad, s, /*accumulate=*/true);
  }
  saved_x_ = saved_mean_ = saved_rstd_ = Tensor();
  return dx;
}

std::vector<Parameter*> NormLayer::parameters() {
  std::vector<Parameter*> p{&weight_};
  if (has_bias()) p.push_back(&bias_);
  return p;
}

void NormLayer::zero_grad() {
  for (Parameter* p : parameters()) p->main_grad.zero_();
}

void NormLayer::stash_activations(ActivationStash& s) {
  s.put(saved_x_);
  s.put(saved_mean_);
  s.put(saved_rstd_);
  s.put_int(saved_fused_ ? 1 : 0);
}

void NormLayer::restore_activations(ActivationStash& s) {
  s.take(saved_x_);
  s.take(saved_mean_);
  s.take(saved_rstd_);
  saved_fused_ = s.take_int() != 0;
}

}  // namespace megacore::layers
