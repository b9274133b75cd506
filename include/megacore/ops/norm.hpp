// LayerNorm and RMSNorm over the last dimension, forward and backward, optionally fused with the
// residual add that precedes them in a pre-norm transformer block.
//
// x is [..., H] (rows = product of the leading dimensions), f32/bf16/f16; weight and bias are [H] of
// x's dtype; y has x's shape and dtype. Statistics are accumulated in f32 (CPU reference: f64) and
// forward saves only what backward needs: per-row mean (LayerNorm) and rstd = 1/sqrt(var + eps), as
// f32 tensors of `rows` elements. Weight and bias gradients are reduced in f32 in a fixed order, so
// they are bit-identical from run to run on the same GPU; dw/db may be f32 (main grads) or x's dtype.
#pragma once

#include <cstdint>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

/// y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps).
void rmsnorm_forward(const Tensor& x, const Tensor& weight, Tensor& y, Tensor& rstd, float eps,
                     const Stream& s = {});
/// Fused pre-norm: h = x + residual is written to residual_out (x's dtype; it is the next residual
/// stream and what backward normalises), then y = rmsnorm(h) * weight.
void rmsnorm_forward_residual(const Tensor& x, const Tensor& residual, const Tensor& weight, Tensor& y,
                              Tensor& residual_out, Tensor& rstd, float eps, const Stream& s = {});
/// dx (and dweight) from dy. x is what forward normalised (residual_out when fused). dweight is
/// overwritten, or added to when accumulate is true (gradient accumulation into main grads).
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd, Tensor& dx,
                      Tensor& dweight, const Stream& s = {}, bool accumulate = false);
/// Backward of rmsnorm_forward_residual: dresidual_out is the gradient arriving on the residual
/// stream; dx = d(norm)/dh + dresidual_out is the gradient of both x and residual.
void rmsnorm_backward_residual(const Tensor& dy, const Tensor& dresidual_out, const Tensor& x, const Tensor& weight,
                               const Tensor& rstd, Tensor& dx, Tensor& dweight, const Stream& s = {},
                               bool accumulate = false);

/// y = (x - mean) * rstd * weight + bias; bias may be undefined (no bias).
void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, Tensor& mean,
                       Tensor& rstd, float eps, const Stream& s = {});
/// Fused pre-norm LayerNorm; see rmsnorm_forward_residual.
void layernorm_forward_residual(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                                Tensor& y, Tensor& residual_out, Tensor& mean, Tensor& rstd, float eps,
                                const Stream& s = {});
/// dx, dweight and dbias (dbias may be undefined to skip it).
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dweight, Tensor& dbias, const Stream& s = {},
                        bool accumulate = false);
/// Backward of layernorm_forward_residual (see rmsnorm_backward_residual).
void layernorm_backward_residual(const Tensor& dy, const Tensor& dresidual_out, const Tensor& x,
                                 const Tensor& weight, const Tensor& mean, const Tensor& rstd, Tensor& dx,
                                 Tensor& dweight, Tensor& dbias, const Stream& s = {}, bool accumulate = false);

namespace ref {
/// Float64 references on raw row-major arrays (for gradient checks and for validating other
/// implementations). `layer` selects LayerNorm (mean subtracted, bias added when b != nullptr).
void norm_forward_f64(bool layer, const double* x, const double* w, const double* b, double* y, double* mean,
                      double* rstd, int64_t rows, int64_t h, double eps);
void norm_backward_f64(bool layer, const double* dy, const double* x, const double* w, const double* mean,
                       const double* rstd, double* dx, double* dw, double* db, int64_t rows, int64_t h);
}  // namespace ref

}  // namespace megacore::ops
