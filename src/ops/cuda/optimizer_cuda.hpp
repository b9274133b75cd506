// Private interface between src/ops/optimizer.cpp / cast.cpp and the multi-tensor kernels (optimizer.cu).
#pragma once

#include <cstdint>
#include <vector>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

struct AdamWArgs {
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  float bias_corr1, bias_corr2;  // 1 - beta^step
  const float* grad_scale_ptr;   // optional
};
/// Storage dtypes of one AdamW launch: grad f32/bf16; master f32, or bf16 with no param_out; exp_avg and
/// exp_avg_sq f32/bf16; param (of param_out) bf16/f16/f32.
struct AdamWDTypes {
  DType grad, master, exp_avg, exp_avg_sq, param;
};
/// ptrs[i] = {grad, master, exp_avg, exp_avg_sq, param_out (or nullptr)}.
void adamw(const AdamWDTypes& dt, const std::vector<std::vector<void*>>& ptrs, const std::vector<int64_t>& n,
           const AdamWArgs& a, int device, void* stream);

struct SGDArgs {
  float lr, momentum, dampening, weight_decay, grad_scale;
  bool nesterov, first_step;
  const float* grad_scale_ptr;  // optional
};
/// ptrs[i] = {grad, master, momentum (or nullptr when momentum == 0), param_out (or nullptr)}.
void sgd(DType grad_dt, DType param_dt, const std::vector<std::vector<void*>>& ptrs, const std::vector<int64_t>& n,
         const SGDArgs& a, int device, void* stream);

/// Bytes of scratch multi_tensor_l2norm needs for these sizes.
size_t l2norm_workspace_bytes(const std::vector<int64_t>& n);
void l2norm(DType dt, const std::vector<const void*>& ptrs, const std::vector<int64_t>& n, float* out,
            void* workspace, int device, void* stream);

void scale(DType src_dt, DType dst_dt, const std::vector<const void*>& src, const std::vector<void*>& dst,
           const std::vector<int64_t>& n, float scale, const float* scale_ptr, int device, void* stream);

void clip_coefficient(const float* norm, float max_norm, float* coef, int device, void* stream);

}  // namespace megacore::ops::cuda
