// Dropout kernel: a thread takes four consecutive elements, which share one Philox evaluation.
#include "ops/cuda/dropout_cuda.hpp"
#include "ops/cuda/memops_common.cuh"
#include "ops/dropout_math.hpp"

namespace megacore::ops::cuda {
namespace {

template <class T, bool VEC>
__global__ void dropout_kernel(const T* x, T* y, uint8_t* mask, int64_t n, uint32_t thr, float scale, uint64_t seed,
                               uint64_t offset) {
  const int64_t groups = (n + 3) / 4;
  for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < groups; q += int64_t(gridDim.x) * blockDim.x) {
    const Philox4 w = philox_words(seed, offset, uint64_t(q));
    const int64_t i0 = 4 * q;
    if (VEC && i0 + 4 <= n) {
      float v[4];
      load_f32_stream<T, 4>(x + i0, v);
      uint32_t mbits = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool keep = dropmath::keep_word(w.v[k], thr);
        v[k] = keep ? v[k] * scale : 0.f;
        mbits |= uint32_t(keep) << (8 * k);
      }
      store_f32_stream<T, 4>(y + i0, v);
      if (mask) *reinterpret_cast<uint32_t*>(mask + i0) = mbits;
    } else {
      for (int k = 0; k < 4 && i0 + k < n; ++k) {
        const bool keep = dropmath::keep_word(w.v[k], thr);
        y[i0 + k] = from_f32<T>(keep ? to_f32(x[i0 + k]) * scale : 0.f);
        if (mask) mask[i0 + k] = uint8_t(keep);
      }
    }
  }
}

}  // namespace

void dropout(DType dt, const void* x, void* y, uint8_t* mask, int64_t n, uint32_t thr, float scale, uint64_t seed,
             uint64_t offset, int device, void* stream) {
  if (n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = (reinterpret_cast<uintptr_t>(x) % (4 * sizeof(T))) == 0 &&
                     (reinterpret_cast<uintptr_t>(y) % (4 * sizeof(T))) == 0 &&
                     (mask == nullptr || reinterpret_cast<uintptr_t>(mask) % 4 == 0);
    const unsigned blocks = elementwise_blocks((n + 3) / 4, 256, device);
    if (vec) dropout_kernel<T, true><<<blocks, 256, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(y), mask, n, thr, scale, seed, offset);
    else dropout_kernel<T, false><<<blocks, 256, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(y), mask, n, thr, scale, seed, offset);
    MC_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace megacore::ops::cuda
