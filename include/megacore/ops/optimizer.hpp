// Optimizer kernels over lists of tensors ("multi-tensor": one launch covers many parameters):
// AdamW (f32 master weights that also write the 16-bit model weights in the same pass, or bf16 weights and
// moments updated in place) and SGD with f32 master weights, the global
// L2 norm (for gradient clipping), and scaling. All lists hold contiguous tensors on one device.
#pragma once

#include <cstdint>
#include <vector>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

struct AdamWHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;  ///< decoupled: w -= lr * weight_decay * w (torch.optim.AdamW)
  int64_t step = 1;            ///< 1-based step number, for bias correction
  float grad_scale = 1.f;      ///< gradients are multiplied by this (1 / loss scale, clip coefficient)
};

/// One AdamW step for every i, computed in f32 (CPU: f64) whatever the storage dtypes:
///   master[i]      f32, or bf16/f32 when it is the parameter itself (no separate master weights: then
///                  params_out must be empty); updated in place, rounded to nearest even when bf16;
///   exp_avg[i], exp_avg_sq[i]  f32 or bf16 (one dtype per list), updated in place, rounded to nearest
///                  even when bf16 (the update itself uses the unrounded new moments);
///   grads[i]       f32 or bf16;
///   params_out     empty, or one per tensor (bf16/f16/f32) receiving the new master weights rounded
///                  to their dtype.
/// grad_scale_tensor (optional f32 [1] on the device) multiplies the gradients as well, so a clip
/// coefficient computed on the GPU needs no host sync.
void multi_tensor_adamw(const std::vector<Tensor>& grads, const std::vector<Tensor>& master,
                        const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
                        const std::vector<Tensor>& params_out, const AdamWHyper& h,
                        const Tensor& grad_scale_tensor = {}, const Stream& s = {});

struct SGDHyper {
  float lr = 1e-3f;
  float momentum = 0.f;
  float dampening = 0.f;
  bool nesterov = false;
  float weight_decay = 0.f;  ///< coupled L2: g += weight_decay * w (torch.optim.SGD)
  bool first_step = false;   ///< the momentum buffer is set to the gradient instead of updated
  float grad_scale = 1.f;    ///< gradients are multiplied by this
};

/// One SGD step (torch.optim.SGD semantics) for every i, in f32: d = g·scale + wd·w; with momentum,
/// buf = first_step ? d : μ·buf + (1 − dampening)·d and d = nesterov ? d + μ·buf : buf; w −= lr·d.
/// master[i] and momentum[i] (f32; momentum may be empty when momentum == 0) are updated in place;
/// grads[i] are f32 or bf16; params_out (empty, or one per tensor, bf16/f16/f32) receive the new
/// master weights rounded to their dtype; grad_scale_tensor (optional f32 [1] on the device) also
/// multiplies the gradients.
void multi_tensor_sgd(const std::vector<Tensor>& grads, const std::vector<Tensor>& master,
                      const std::vector<Tensor>& momentum, const std::vector<Tensor>& params_out, const SGDHyper& h,
                      const Tensor& grad_scale_tensor = {}, const Stream& s = {});

/// out (f32 [1], on the tensors' device) = sqrt(sum over all tensors of sum x^2), accumulated in
/// f32 (CPU: f64) in a fixed order, so the result is identical from run to run.
void multi_tensor_l2norm(const std::vector<Tensor>& tensors, Tensor& out, const Stream& s = {});

/// dst[i] = src[i] * scale (* scale_tensor[0] when given); dst may be src; dtypes may differ (a cast).
void multi_tensor_scale(const std::vector<Tensor>& src, const std::vector<Tensor>& dst, float scale,
                        const Tensor& scale_tensor = {}, const Stream& s = {});

/// Clip coefficient for a max norm, on the device: coef = min(1, max_norm / (norm + 1e-6)), f32 [1].
void clip_coefficient(const Tensor& norm, float max_norm, Tensor& coef, const Stream& s = {});

}  // namespace megacore::ops
