// Grouped GEMM through cuBLAS's cublasGemmGroupedBatchedEx (CUDA 12.5+): every expert's product in
// one call, each group a problem of its own row count.
//
// cuBLAS is column-major; a row-major C = op(A) op(B) runs as the column-major C^T = op(B)^T op(A)^T,
// so cuBLAS's "A" is our B with m and n swapped (as in gemm_cublaslt.cpp). The grouped API takes
// its sizes, leading dimensions and scalars from host arrays but the matrix pointers from device
// arrays, which a small kernel writes on the call's stream (the pointers travel as its arguments,
// so no host copy waits for the stream).
// cuBLAS documents grouped kernels for A = B = C in f16 or bf16 (f32 compute) and f32 (a 16-bit
// product into an f32 C, the main-grad case of wgrad, is not among them: the caller loops over
// ops::gemm then).
#include <cublas_v2.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/cuda/cuda_check.hpp"
#include "ops/cuda/cublas_check.hpp"
#include "megacore/core/tensor.hpp"
#include "ops/cuda/moe_cuda.hpp"


namespace megacore::ops::cuda {
namespace {

// One cuBLAS handle per device. The handle's stream is per call, so calls are serialised on it.
struct BlasHandles {
  std::mutex mu;
  std::unordered_map<int, cublasHandle_t> handles;  // never destroyed: the driver may be gone at exit
  cublasHandle_t get(int device) {
    auto it = handles.find(device);
    if (it != handles.end()) return it->second;
    cublasHandle_t h;
    MC_CUBLAS_CHECK(cublasCreate(&h));
    handles.emplace(device, h);
    return h;
  }
};

BlasHandles& blas_handles() {
  static BlasHandles* h = new BlasHandles();
  return *h;
}

cudaDataType_t cuda_type(DType dt) {
  switch (dt) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

}  // namespace

bool grouped_gemm(const GroupedGemm& g, int device, void* stream) {
  if (g.ab != g.c) return false;  // not a documented grouped combination
  const int64_t count = g.groups;
  const size_t cnt = static_cast<size_t>(count);
  std::vector<cublasOperation_t> ta(cnt, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
  std::vector<cublasOperation_t> tb(cnt, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
  std::vector<int64_t> m(cnt), n(cnt), k(cnt), lda(cnt), ldb(cnt), ldc(cnt), group_size(cnt, 1);
  std::vector<float> alpha(cnt, 1.f), beta(cnt, g.beta);
  // [A pointers | B pointers | C pointers], cuBLAS's operands (ours swapped).
  std::vector<const void*> ptrs(3 * cnt);
  for (int64_t i = 0; i < count; ++i) {
    m[size_t(i)] = g.n[i], n[size_t(i)] = g.m[i], k[size_t(i)] = g.k[i];
    lda[size_t(i)] = g.ldb[i], ldb[size_t(i)] = g.lda[i], ldc[size_t(i)] = g.ldc[i];
    ptrs[size_t(i)] = g.b[i];
    ptrs[size_t(count + i)] = g.a[i];
    ptrs[size_t(2 * count + i)] = g.cptr[i];
  }
  cuda_impl::DeviceGuard guard(device);
  auto cs = static_cast<cudaStream_t>(stream);
  Tensor dev_ptrs =
      Tensor::empty({3 * count}, DType::I64, Device::cuda(device), Stream::from_native(Device::cuda(device), stream));
  upload_pointers(ptrs.data(), 3 * count, static_cast<void**>(dev_ptrs.data_ptr()), device, stream);
  auto* d = static_cast<void**>(dev_ptrs.data_ptr());
  const cudaDataType_t ab = cuda_type(g.ab), c = cuda_type(g.c);
  std::lock_guard<std::mutex> lock(blas_handles().mu);
  cublasHandle_t h = blas_handles().get(device);
  MC_CUBLAS_CHECK(cublasSetStream(h, cs));
  MC_CUBLAS_CHECK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  const cublasStatus_t st = cublasGemmGroupedBatchedEx_64(
      h, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), d, ab, lda.data(), d + count, ab,
      ldb.data(), beta.data(), d + 2 * count, c, ldc.data(), count, group_size.data(), CUBLAS_COMPUTE_32F);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  MC_CUBLAS_CHECK(st);
  return true;
}

}  // namespace megacore::ops::cuda
