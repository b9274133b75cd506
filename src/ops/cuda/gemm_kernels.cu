// Helper kernels for the cuBLASLt GEMM path.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/cuda/cuda_check.hpp"
#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {
namespace {

template <class T>
__device__ __forceinline__ float to_f32(T v) { return float(v); }

template <class T>
__device__ __forceinline__ T from_f32(float v) { return T(v); }

// One warp per output row: out[r] = sum_k x[r * sr + k * sk], accumulated in f32 in a fixed order.
template <class TIn, class TOut>
__global__ void row_sum_kernel(const TIn* x, int64_t rows, int64_t k, int64_t sr, int64_t sk, TOut* out) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  float acc = 0.f;
  for (int64_t i = lane; i < k; i += 32) acc += to_f32(x[r * sr + i * sk]);
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) out[r] = from_f32<TOut>(acc);
}

template <class TIn>
void launch_for_out(const TIn* x, int64_t rows, int64_t k, int64_t sr, int64_t sk, DType out_dt, void* out,
                    cudaStream_t s) {
  const int warps = 8;
  const dim3 grid(unsigned((rows + warps - 1) / warps));
  switch (out_dt) {
    case DType::F32: row_sum_kernel<<<grid, warps * 32, 0, s>>>(x, rows, k, sr, sk, static_cast<float*>(out)); break;
    case DType::BF16:
      row_sum_kernel<<<grid, warps * 32, 0, s>>>(x, rows, k, sr, sk, static_cast<bfloat16*>(out));
      break;
    case DType::F16:
      row_sum_kernel<<<grid, warps * 32, 0, s>>>(x, rows, k, sr, sk, static_cast<float16*>(out));
      break;
    default: break;
  }
}

}  // namespace

void bias_grad_reduce(DType in_dt, const void* x, int64_t rows, int64_t k, int64_t sr, int64_t sk, DType out_dt,
                      void* out, void* stream) {
  if (rows == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  switch (in_dt) {
    case DType::F32: launch_for_out(static_cast<const float*>(x), rows, k, sr, sk, out_dt, out, s); break;
    case DType::BF16: launch_for_out(static_cast<const bfloat16*>(x), rows, k, sr, sk, out_dt, out, s); break;
    case DType::F16: launch_for_out(static_cast<const float16*>(x), rows, k, sr, sk, out_dt, out, s); break;
    default: break;
  }
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace megacore::ops::cuda
