// Private interface between src/ops/gemm.cpp and its cuBLASLt implementation (gemm_cublaslt.cpp).
#pragma once

#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

/// One (strided-batched) product in row-major terms, already validated and normalised: every
/// operand is row-major in its stored shape with leading dimension ld (elements) and batch stride
/// (elements, 0 = shared by all batch entries).
struct GemmProblem {
  DType ab_dtype = DType::F32;
  DType out_dtype = DType::F32;
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0, batch = 1;
  const void* a = nullptr;
  int64_t lda = 0, stride_a = 0;
  const void* b = nullptr;
  int64_t ldb = 0, stride_b = 0;
  void* c = nullptr;
  int64_t ldc = 0, stride_c = 0;
  const void* c_in = nullptr;  // the beta term's source when it is not c (GemmOptions::c); same dtype as c
  int64_t ldc_in = 0, stride_c_in = 0;
  float alpha = 1.f, beta = 0.f;
  int epilogue = 0;  // ops::GemmEpilogue
  void* bias = nullptr;
  DType bias_dtype = DType::F32;
  bool allow_tf32 = false;
  int sm_margin = 0;  // SMs left free (ops::gemm_sm_margin); 0 = all SMs
  int autotune_candidates = 0;  // > 1: time this many heuristic candidates when the plan is made (only
                                // with beta = 0 on a stream that is not being captured)
};

/// Runs the product on `stream` of `device` (workspace from megacore's caching allocator).
void gemm(const GemmProblem& p, int device, void* stream);

/// Number of cached cuBLASLt plans (for tests of the cache).
int64_t gemm_plan_cache_size();

/// Number of cached plans whose timed choice is not the heuristic's first (for tests and benchmarks).
int64_t gemm_autotuned_plan_count();

}  // namespace megacore::ops::cuda

namespace megacore::ops::cuda {

/// ops::gemm_fp8 on device pointers: out[M, N] (ld ldc) = sa · sb · a[M, K] (ld lda) · b[N, K]ᵀ (ld ldb)
/// + beta · out, a and b FP8, out bf16 or f32, sa/sb device f32 scalars.
struct GemmFp8Problem {
  DType a_dtype = DType::F8E4M3, b_dtype = DType::F8E4M3, out_dtype = DType::BF16;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  const float* scale_inv_a = nullptr;
  const float* scale_inv_b = nullptr;
  float beta = 0.f;
  bool fast_accum = false;
  int sm_margin = 0;
  /// > 1: time this many heuristic candidates on the first call of the shape (beta = 0 only), as GemmProblem.
  int autotune_candidates = 0;
};
void gemm_fp8(const GemmFp8Problem& p, int device, void* stream);

}  // namespace megacore::ops::cuda
