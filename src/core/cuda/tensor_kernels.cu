// Elementwise kernels behind Tensor: fill, Philox random draws, strided copy with conversion.
// All of them walk the logical (row-major) index, so a value depends only on its index, not on the
// layout in memory or the launch configuration.
#include <cuda_runtime.h>

#include "core/cuda/cuda_check.hpp"
#include "core/cuda_backend.hpp"
#include "megacore/core/random.hpp"

namespace megacore::cuda_impl {
namespace {

__device__ __forceinline__ int64_t strided_offset(int64_t i, const StridedDesc& d) {
  int64_t off = 0;
  for (int k = d.ndim - 1; k >= 0; --k) {
    int64_t n = d.shape[k];
    off += (i % n) * d.stride[k];
    i /= n;
  }
  return off;
}

template <class D, class S> __device__ __forceinline__ D convert(S v) {
  if constexpr (is_narrow_float_v<S>) {
    return convert<D, float>(float(v));
  } else if constexpr (is_narrow_float_v<D>) {
    return D(float(v));
  } else {
    return static_cast<D>(v);
  }
}

template <class T>
__global__ void fill_kernel(T* data, StridedDesc d, T value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < d.numel; i += int64_t(gridDim.x) * blockDim.x)
    data[strided_offset(i, d)] = value;
}

template <class T>
__global__ void random_kernel(T* data, StridedDesc d, RandomKind kind, uint64_t seed, uint64_t offset, double a,
                              double b) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < d.numel; i += int64_t(gridDim.x) * blockDim.x) {
    float r = kind == RandomKind::Uniform ? philox_uniform(seed, offset, uint64_t(i)) : philox_normal(seed, offset, uint64_t(i));
    // The affine map is done in f32 on both host and device so both round identically.
    float v = kind == RandomKind::Uniform ? float(a) + (float(b) - float(a)) * r : float(a) + float(b) * r;
    data[strided_offset(i, d)] = convert<T, float>(v);
  }
}

template <class D, class S>
__global__ void copy_kernel(D* dst, StridedDesc dd, const S* src, StridedDesc sd) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < dd.numel; i += int64_t(gridDim.x) * blockDim.x)
    dst[strided_offset(i, dd)] = convert<D, S>(src[strided_offset(i, sd)]);
}

unsigned grid_for(int64_t n) {
  int64_t blocks = (n + 255) / 256;
  return unsigned(blocks < 65535 * 8 ? (blocks < 1 ? 1 : blocks) : 65535 * 8);
}

template <class F>
void dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: f(float{}); break;
    case DType::BF16: f(bfloat16{}); break;
    case DType::F16: f(float16{}); break;
    case DType::I32: f(int32_t{}); break;
    case DType::I64: f(int64_t{}); break;
    case DType::U8: f(uint8_t{}); break;
    case DType::F8E4M3: f(float8_e4m3{}); break;
    case DType::F8E5M2: f(float8_e5m2{}); break;
  }
}

}  // namespace

void fill(void* data, DType dt, const StridedDesc& d, double value, void* stream, int device) {
  if (d.numel == 0) return;
  DeviceGuard g(device);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    T v;
    if constexpr (is_narrow_float_v<T>) v = T(float(value));
    else v = static_cast<T>(value);
    fill_kernel<T><<<grid_for(d.numel), 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<T*>(data), d, v);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void random(void* data, DType dt, const StridedDesc& d, RandomKind kind, uint64_t seed, uint64_t offset, double a,
            double b, void* stream, int device) {
  if (d.numel == 0) return;
  DeviceGuard g(device);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    random_kernel<T><<<grid_for(d.numel), 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<T*>(data), d, kind,
                                                                                        seed, offset, a, b);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void copy(void* dst, DType dst_dt, const StridedDesc& dd, const void* src, DType src_dt, const StridedDesc& sd,
          void* stream, int device) {
  if (dd.numel == 0) return;
  DeviceGuard g(device);
  dispatch(dst_dt, [&](auto dtag) {
    using D = decltype(dtag);
    dispatch(src_dt, [&](auto stag) {
      using S = decltype(stag);
      copy_kernel<D, S><<<grid_for(dd.numel), 256, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<D*>(dst), dd, static_cast<const S*>(src), sd);
    });
  });
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace megacore::cuda_impl
