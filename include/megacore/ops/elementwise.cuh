// The CUDA kernel of ops::elementwise (ops/elementwise.hpp): one user functor applied per element.
//
// Include this in a .cu file to run a functor the library did not compile on a GPU:
//
//   #include <megacore/ops/elementwise.cuh>
//   MEGACORE_INSTANTIATE_ELEMENTWISE(megacore::bfloat16, my::Square)
//
// The library's own instantiations (float, bfloat16, float16 x ops::fn::{Relu, SquaredRelu, Silu,
// GeluTanh}) live in src/ops/cuda/elementwise.cu. The kernel is a grid-stride loop, one element per
// thread per round with the math in f32: memory-bound like the built-in activations, but without their
// 16-byte vector loads, so for GELU/SiLU on bf16 ops::activation_forward stays the faster path.
// C++17 (the library compiles its CUDA sources as C++17), host side needs only the CUDA runtime.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda_launch {

/// Grad = false: out[i] = f(x[i]). Grad = true: out[i] = dy[i] * f.grad(x[i]). Math in float.
template <class T, class F, bool Grad>
__global__ void elementwise_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out, int64_t n,
                                   F f) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const float v = float(x[i]);
    if constexpr (Grad) out[i] = T(float(dy[i]) * f.grad(v));
    else out[i] = T(f(v));
  }
}

/// Launches elementwise_kernel on `stream` (a cudaStream_t) of CUDA device `device`.
/// @param x       [n] T, device memory, read
/// @param dy      [n] T, read when Grad (else nullptr)
/// @param out     [n] T, written; may be x or dy
/// @param f       the functor, copied to the device by value
/// @return nullptr on success, else CUDA's error text (the caller raises CudaError with it)
template <class T, class F, bool Grad>
const char* elementwise(const T* x, const T* dy, T* out, int64_t n, F f, int device, void* stream) {
  if (n == 0) return nullptr;
  int prev = 0;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  int sms = 0;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  constexpr int kThreads = 256;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int blocks = int(want < int64_t(sms) * 8 ? want : int64_t(sms) * 8);  // 8 blocks/SM, then grid-stride
  elementwise_kernel<T, F, Grad><<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, dy, out, n, f);
  e = cudaGetLastError();
  if (prev != device) cudaSetDevice(prev);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace megacore::ops::cuda_launch

/// Compiles ops::elementwise's forward and gradient kernels for element type T and functor F.
#define MEGACORE_INSTANTIATE_ELEMENTWISE(T, F)                                                             \
  template const char* megacore::ops::cuda_launch::elementwise<T, F, false>(const T*, const T*, T*, int64_t, F, \
                                                                            int, void*);                    \
  template const char* megacore::ops::cuda_launch::elementwise<T, F, true>(const T*, const T*, T*, int64_t, F, int, \
                                                                           void*);
