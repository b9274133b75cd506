// FP8 matrix product with per-tensor scales (the GEMM of FP8 linear layers).
//
//   out[M, N] = scale_inv_a · scale_inv_b · a[M, K] · b[N, K]ᵀ + beta · out
//
// Both operands are K-contiguous (row-major [M, K] and [N, K]): cuBLASLt's FP8 kernels take only the
// "TN" layout, so a layer that needs another product transposes its FP8 operand once (the cached
// transposed weight, the transposed activations of the weight gradient). Products of two FP8 values are
// exact in f32 and accumulate in f32; the scales multiply the f32 sum.
//
// On CUDA (compute capability 8.9 or newer) through cuBLASLt with A/B scale pointers, so the scales stay
// on the device; on the CPU an emulation (decode to f32, f32 GEMM, times the scales), the reference the
// CUDA path is tested against: equal up to f32 summation order.
#pragma once

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

struct GemmFp8Options {
  /// 0 overwrites out; 1 accumulates into it (weight gradients into f32 main grads).
  float beta = 0.f;
  /// cuBLASLt's FAST_ACCUM (fewer promotions of the tensor cores' partial sums to full f32): Transformer
  /// Engine uses it for the forward product and not for gradients. Ignored on the CPU.
  bool fast_accum = false;
};

/// True when cuBLASLt's FP8 kernels take the shape: M, N and K multiples of 16. gemm_fp8 refuses others
/// (a layer checks this first and keeps that product in bf16).
bool gemm_fp8_supported(int64_t m, int64_t n, int64_t k);

/// out = scale_inv_a · scale_inv_b · a bᵀ + beta · out.
///   a            F8E4M3 or F8E5M2 [M, K], contiguous (in)
///   b            F8E4M3 or F8E5M2 [N, K], contiguous (in); not both E5M2 (no such kernel)
///   out          bf16 or f32 [M, N], contiguous (out; read when beta != 0)
///   scale_inv_a  f32, one element: a's 1 / scale (in); scale_inv_b likewise
/// ValueError for other dtypes or layouts, or M, N, K not multiples of 16.
void gemm_fp8(const Tensor& a, const Tensor& b, Tensor& out, const Tensor& scale_inv_a, const Tensor& scale_inv_b,
              const GemmFp8Options& opts = {}, const Stream& s = {});

}  // namespace megacore::ops
