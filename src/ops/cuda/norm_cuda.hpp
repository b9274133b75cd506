// Private interface between src/ops/norm.cpp and its CUDA kernels (norm.cu). Plain pointers only,
// so the host side needs no CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

struct NormForwardArgs {
  bool layer = false;         // LayerNorm (else RMSNorm)
  const void* x = nullptr;
  const void* residual = nullptr;  // optional: h = x + residual
  const void* w = nullptr;
  const void* b = nullptr;    // optional (LayerNorm only)
  void* y = nullptr;
  void* residual_out = nullptr;    // written when residual is given
  float* mean = nullptr;      // LayerNorm only
  float* rstd = nullptr;
  int64_t rows = 0, h = 0;
  float eps = 0;
};
void norm_forward(DType dt, const NormForwardArgs& a, int device, void* stream);

struct NormBackwardArgs {
  bool layer = false;
  const void* dy = nullptr;
  const void* dresidual = nullptr;  // optional, added to dx
  const void* x = nullptr;
  const void* w = nullptr;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  void* dx = nullptr;
  void* dw = nullptr;
  DType dw_dtype = DType::F32;
  void* db = nullptr;  // optional
  DType db_dtype = DType::F32;
  bool accumulate = false;
  int64_t rows = 0, h = 0;
};
/// Bytes of f32 scratch norm_backward needs (per-block partial weight/bias gradients).
size_t norm_backward_workspace_bytes(const NormBackwardArgs& a, DType dt, int device);
void norm_backward(DType dt, const NormBackwardArgs& a, void* workspace, int device, void* stream);

}  // namespace megacore::ops::cuda
